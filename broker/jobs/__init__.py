"""Offline jobs: records, chunking, fills and stops, progress, lists, finish prediction, output folders."""
