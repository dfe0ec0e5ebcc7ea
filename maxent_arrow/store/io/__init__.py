"""Reading and writing units: the commit, the writer, the checked reader of group files, the
IPC cache and replay. Imports the history and storage layers.
"""
