"""Types of the C extension built from csrc/kvx_cuda.c; without it, CuPy launches (kvx/_datapath/gpu.py)."""

def load() -> None: ...
def launch(
    function: int,
    stream: int,
    host: int,
    dev: int,
    nbytes: int,
    n: int,
    grid: int,
    threads: int,
    event: int,
    /,
) -> None: ...
def wait(event: int, spin_us: float, /) -> None: ...
