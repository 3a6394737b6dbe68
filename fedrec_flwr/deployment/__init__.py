"""Deployment files: per-node data files and the public catalogue (`node_data`)."""
