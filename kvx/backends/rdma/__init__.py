"""The rdma backend: one-sided READ and WRITE over RDMA NICs (libfabric or verbs)."""
