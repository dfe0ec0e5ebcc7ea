"""Storage primitives: the file-system seam, file names, checksums, verified reads,
Parquet settings and the layout's padding. Imports nothing else of the store.
"""
