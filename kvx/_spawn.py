"""Child processes that die with their parent, started without Python in the fork.

``preexec_fn`` runs Python between ``fork`` and ``exec``. That makes CPython
fork instead of vfork, so every ``pthread_atfork`` handler runs in the child, and
gRPC's restarts its event-engine poller there; the child then closes its file
descriptors before ``exec`` (``close_fds``), the poller's ``epoll_wait`` meets
a closed descriptor, and the child aborts before it ever becomes the engine
(grpc/grpc#43055). A daemon holds a metadata channel when it starts its engine,
so this happened about once in 15 starts.

Instead the child is a small launcher that sets ``PR_SET_PDEATHSIG`` itself
and then ``exec``s the real command: no Python runs in the forked copy of the
parent, and the parent's threads cannot reach the child.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence

# argv: parent pid, the command. The check of the parent's pid closes the race
# where the parent died before prctl: the child would then outlive it forever.
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL,0,0,0)\n"  # PR_SET_PDEATHSIG
    "os.getppid()==int(sys.argv[1]) or os._exit(70)\n"
    "os.execv(sys.argv[2],sys.argv[2:])\n"
)


def dying_with_parent(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """``argv`` to give ``subprocess.Popen`` (without ``preexec_fn``) so that
    the command gets SIGKILL when this process dies, however it dies.

    The command is resolved on ``env``'s PATH here, so a missing program
    raises FileNotFoundError in the parent, as Popen itself would. Off Linux
    the command is returned as it is.
    """
    if not argv:
        raise ValueError("an empty command")
    if sys.platform != "linux":
        return list(argv)
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    program = shutil.which(argv[0], path=path)
    if program is None:
        raise FileNotFoundError(2, "No such file or directory", argv[0])
    # -I -S: the launcher reads no environment and imports no site packages.
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _LAUNCHER,
        str(os.getpid()),
        os.path.abspath(program),
        *argv[1:],
    ]
