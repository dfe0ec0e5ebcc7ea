"""Keeping a store sound: compaction, repair, verify and upgrade (a store without a commit
log given one).
"""
