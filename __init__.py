"""cutebwd"""
