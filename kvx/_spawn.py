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

import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

# argv: what to do as JSON, then the command. "parent": the pid whose death
# kills the command (PR_SET_PDEATHSIG); checked after prctl, which closes the
# race where the parent died first and the command would outlive it forever.
# "cpus": the CPU affinity. "drop": capabilities to drop from the bounding set.
_LAUNCHER = (
    "import ctypes,json,os,signal,sys\n"
    "o=json.loads(sys.argv[1]);prctl=ctypes.CDLL(None,use_errno=True).prctl\n"
    "for c in o.get('drop',()):\n"
    " prctl(24,c,0,0,0)==0 or os._exit(77)\n"  # PR_CAPBSET_DROP
    "o.get('cpus') and os.sched_setaffinity(0,o['cpus'])\n"
    "if o.get('parent'):\n"
    " prctl(1,signal.SIGKILL,0,0,0)\n"  # PR_SET_PDEATHSIG
    " os.getppid()==o['parent'] or os._exit(70)\n"
    # Python ignores these at start-up; ignored signals stay ignored across exec.
    "signal.signal(signal.SIGPIPE,signal.SIG_DFL);signal.signal(signal.SIGXFSZ,signal.SIG_DFL)\n"
    # execvp: found on the PATH and in the cwd the command gets, argv[0] as given.
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)
PARENT_GONE = 70  # the launcher's exit status when its parent died before it could watch it
CANNOT_DROP = 77  # ... when a capability could not be dropped (no CAP_SETPCAP)


def dying_with_parent(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """``argv`` to give ``subprocess.Popen`` (without ``preexec_fn``) so that
    the command gets SIGKILL when this process dies, however it dies.
    Off Linux the command is returned as it is."""
    if sys.platform != "linux":
        return list(argv)
    return launched(argv, env, die_with_parent=True)


def launched(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    die_with_parent: bool = False,
    cpus: Sequence[int] = (),
    drop_capabilities: Sequence[int] = (),
) -> list[str]:
    """``argv`` wrapped in the launcher, which sets up the process as asked
    (Linux only) and then execs the command.

    A bare program name is looked up on ``env``'s PATH here too, so a
    missing one raises FileNotFoundError in the parent, as Popen itself
    would; a path (``./tool``) is left to the launcher, which runs in the
    cwd given to Popen. Anything else that stops the exec (a file that is
    not executable) ends the launcher with status 1 and a traceback.
    """
    if not argv:
        raise ValueError("an empty command")
    if sys.platform != "linux":
        raise OSError("the launcher sets Linux process attributes (prctl)")
    if "/" not in argv[0]:
        path = (env if env is not None else os.environ).get("PATH", os.defpath)
        if shutil.which(argv[0], path=path) is None:
            raise FileNotFoundError(2, "No such file or directory", argv[0])
    what = {
        "parent": os.getpid() if die_with_parent else 0,
        "cpus": [int(c) for c in cpus],
        "drop": [int(c) for c in drop_capabilities],
    }
    # -I -S: the launcher reads no environment and imports no site packages.
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(what), *argv]
