"""The byte path the backends share, apart from the public API.

- ``io``: socket scatter-gather (``sendv``, ``recvv``) and cross-memory
  attach (``vm_readv``, ``vm_writev``, ``memcpyv``): the C extensions
  ``_native`` and ``_cma`` (csrc/) or their pure-Python twins ``io_py`` and
  ``cma_py``, picked by ``KVX_NATIVE``.
- ``staging``: GPU memory moved through pinned host buffers.
- ``gpu``: CUDA regions, copy engines and CUDA IPC mappings (CuPy, lazily;
  the copy kernel launched through the driver by the C extension ``_cuda``).
- ``shared``: ``kvx.alloc_shared`` memory (memfd segments).

Nothing here knows about agents, peers or the wire format.
"""
