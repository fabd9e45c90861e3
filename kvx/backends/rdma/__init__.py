"""The rdma backend."""
