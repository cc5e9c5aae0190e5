"""Tiling descriptions (tile shapes, stages, clusters, shape buckets) shared by the sm_90a and sm_100a builds; filled as the GEMM-based kernels land."""
