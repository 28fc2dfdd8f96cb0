"""An engine core process on this machine: its command line, the folder of its ipc:// sockets, and the one
`pagedllm serve` starts before anything else.

A core process spends its first ~1.5 s importing torch and the engine, and the front spends ~2 s importing torch,
FastAPI and the routes before it would start the core. `pagedllm serve` therefore starts its core first
(``prestart``, from entrypoints/cli.py), with the addresses it will bind later: both import side by side and the
core connects once the front binds (ZeroMQ connects before the peer binds). engine/core_client.py's MPClient
``claim``s it; whatever the front decides instead (a thread core, data-parallel replicas, an error, ``--help``)
``release`` kills it, and if the front dies first the core exits with it (``--parent-pid``, PR_SET_PDEATHSIG).

Light on purpose: the standard library only, as it runs before the heavy imports.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CORE_MODULE = "pagedllm.engine.core_proc"
SOCKET_DIR_PREFIX = "pagedllm-core-"
"""The temporary folder of a local core's ipc:// sockets: this prefix, the front's pid, a dash, a random part (short:
a socket's whole path must fit 107 bytes); its file ``NAMESPACE_FILE`` names the pid namespace of that pid."""
_SOCKET_DIR = re.compile(re.escape(SOCKET_DIR_PREFIX) + r"(\d+)-")
NAMESPACE_FILE = "pidns"
SOCKET_NAMES = ("commands", "results")
"""The core's two sockets: it reads commands from the first and sends results on the second."""


def core_command(argv: list[str]) -> list[str]:
    """The command line of a core process started by this one (``argv``: its ZeroMQ addresses and options)."""
    return [sys.executable, "-m", CORE_MODULE, *argv, "--parent-pid", str(os.getpid())]


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 where there is none): a pid names a process
    only inside its namespace, and containers sharing a temp folder each have their own."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def make_socket_dir() -> str:
    """A new socket folder of this process (see SOCKET_DIR_PREFIX), its pid namespace written in it."""
    folder = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    with open(os.path.join(folder, NAMESPACE_FILE), "w") as f:
        f.write(str(pid_namespace()))
    return folder


def socket_addresses(folder: str) -> list[str]:
    """The ipc:// addresses of the core's sockets (SOCKET_NAMES) in ``folder``."""
    return [f"ipc://{folder}/{name}" for name in SOCKET_NAMES]


def sweep_socket_dirs(root: str | None = None) -> list[str]:
    """Remove the socket folders (in ``root``, default the temp folder) that fronts now dead left behind: a
    front removes its own once the core has connected, or on close, but one SIGKILLed while its core loaded
    could not (and its core dies with it). Only this user's folders, made in this pid namespace, of pids no longer
    running."""
    root = root or tempfile.gettempdir()
    removed, namespace = [], str(pid_namespace())
    try:
        entries = list(os.scandir(root))
    except OSError:  # no temp folder to read: nothing to sweep
        return removed
    for entry in entries:
        match = _SOCKET_DIR.match(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
            with open(os.path.join(entry.path, NAMESPACE_FILE)) as f:
                if f.read(32) != namespace:  # another container's pids are not ours to judge
                    continue
            os.kill(int(match[1]), 0)  # signal 0: only asks whether the pid runs
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        except (OSError, OverflowError):  # another user's pid (running), gone mid-scan or unmarked, out of range
            continue
    return removed


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as vLLM does: each connection is a file); the new soft
    limit. Called before a core starts, so that it and its workers inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as e:  # a sandbox may forbid it: serve with what there is
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
    return soft


@dataclass
class PrestartedCore:
    """A core process started before its front knew its configuration (it waits for StartCore)."""

    proc: subprocess.Popen
    folder: str
    """Its socket folder (the front binds SOCKET_NAMES there)."""
    addresses: list[str]


_prestarted: PrestartedCore | None = None


def prestart() -> None:
    """Start the core process of a `pagedllm serve` now, before the front's own imports (see the module
    docstring); idempotent. The core waits for the front to bind its sockets and send StartCore."""
    global _prestarted
    if _prestarted is not None:
        return
    raise_open_file_limit()
    sweep_socket_dirs()  # what a SIGKILLed front left behind
    folder = make_socket_dir()
    addresses = socket_addresses(folder)
    try:
        proc = subprocess.Popen(core_command(addresses))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    _prestarted = PrestartedCore(proc, folder, addresses)
    atexit.register(release)  # an exit that never reached the engine (a bad flag, --help): the core goes too


def claim() -> PrestartedCore | None:
    """The prestarted core, now the caller's to bind, talk to and stop (None if there is none)."""
    global _prestarted
    core, _prestarted = _prestarted, None
    return core


def release() -> None:
    """Stop a prestarted core nobody claimed (the front runs its engine otherwise, or exits); idempotent."""
    core = claim()
    if core is None:
        return
    if core.proc.poll() is None:
        core.proc.kill()
    core.proc.wait()
    shutil.rmtree(core.folder, ignore_errors=True)
