"""Helpers the ops use at run time: output allocation, capture and device facts, CUDA-graph planning,
graph-tree routing and the choice of merge function."""
