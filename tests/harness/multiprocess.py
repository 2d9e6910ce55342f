"""Run test code under N gloo processes with a hard deadline; a stuck collective fails, never hangs.

Three ways in: :func:`run_in_processes` runs a picklable function on every rank of a fresh gloo
world and returns the per-rank results; :func:`run_script` launches a script through ``torchrun``
in its own process group; :func:`launch_preforked` (and :func:`run_preforked`) runs a
CPU-simulation script's ranks as forks of a server that has already imported torch and Megatron.
All kill every child on failure or timeout.
"""

from __future__ import annotations

import contextlib
import ctypes

import multiprocessing as mp
import os
import queue
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil
import torch
import torch.distributed as dist

from tools.functional_tests.runner import torchrun_command

REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerFailure(RuntimeError):
    """A rank raised, died or ran past the deadline; the message names the rank and the cause."""


def rendezvous_store() -> dist.TCPStore:
    """The store a launch's ranks meet at, hosted by this process as torchrun's agent hosts its
    own, on a port the kernel picks when it binds: no port is chosen first and taken by another
    launch before it is bound. Keep it alive until the ranks are done."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def torchrun_variables(rank: int, world_size: int, store: dist.TCPStore) -> dict[str, str]:
    """What torchrun exports to each rank: its coordinates and the agent's store, which every
    rank joins as a client (``TORCHELASTIC_USE_AGENT_STORE``)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _torchrun_threads() -> None:
    """Size this rank's intra-op thread pool as torchrun sizes a rank's (``OMP_NUM_THREADS``, 1
    unless set): a forked or spawned rank would otherwise keep one thread per core, and a world
    of them on a 2-core machine spends most of its CPU spinning in each other's way (a 3-rank
    tiny run: 7-10 s of CPU per rank with 2 threads, 1.4-1.6 s with 1)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def _worker(fn: Callable[..., Any], variables: dict[str, str], args: Sequence[Any],
            env: dict[str, str], results: "mp.Queue[tuple[int, bool, Any]]") -> None:
    os.environ.update(env)
    os.environ.update(variables)
    _torchrun_threads()
    rank, world_size = int(variables["RANK"]), int(variables["WORLD_SIZE"])
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(*args)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent as text
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, value))
    if dist.is_initialized():
        dist.destroy_process_group()


def _deaths(processes: Sequence[mp.Process], skip: Sequence[int]) -> str:
    """'rank R died with exit code C; ' for each rank that exited abnormally without reporting."""
    return "".join(
        f"rank {rank} died with exit code {process.exitcode}; "
        for rank, process in enumerate(processes)
        if rank not in skip and process.exitcode not in (None, 0)
    )


def _more_failures(results: "mp.Queue[tuple[int, bool, Any]]") -> list[tuple[int, str]]:
    """Failures other ranks have already reported, so the one that started it is named too."""
    failures = []
    with contextlib.suppress(queue.Empty):
        while True:
            rank, ok, value = results.get(timeout=0.1)
            if not ok:
                failures.append((rank, value))
    return failures


def _kill(processes: Sequence[mp.Process]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=10)


SIMULATION_PRELOAD = "tests.harness.simulation_preload"


def _context(simulated: bool) -> Any:
    """Fresh interpreters (spawn), or forks of one server that already activated the CPU
    simulation and imported Megatron (:mod:`tests.harness.simulation_preload`)."""
    if not simulated:
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([SIMULATION_PRELOAD])
    return context


def start_simulation_server() -> None:
    """Start the simulated ranks' forkserver if it is not running yet (it imports torch and
    Megatron once, seconds of CPU), so that what the caller times next is its launch alone."""
    run_in_processes(int, 1, simulated=True, timeout=300)


def run_in_processes(fn: Callable[..., Any], world_size: int, *, timeout: float = 90.0,
                     args: Sequence[Any] = (), env: dict[str, str] | None = None,
                     simulated: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ranks 0..world_size-1 of a fresh gloo world; results in rank order.

    ``fn`` must be importable by name (children unpickle it). ``simulated``: ``fn`` starts with
    ``cpu_simulation.patches.activate()``, so its ranks may be forked with that done and Megatron
    imported; they get this process's current environment, as spawned ones do. The first rank to
    raise or die fails the whole run at once, with its traceback; ranks still waiting are killed.
    """
    context = _context(simulated)
    results = context.Queue()
    store = rendezvous_store()
    environment = {**(os.environ if simulated else {}), **(env or {})}
    processes = [
        context.Process(target=_worker, args=(fn, torchrun_variables(rank, world_size, store),
                                              tuple(args), environment, results))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                deaths = _deaths(processes, list(collected))
                if deaths:
                    raise WorkerFailure(f"{deaths}before reporting") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise WorkerFailure(
                        f"ranks {missing} did not finish within {timeout:.0f} s (killed)"
                    ) from None
                continue
            if not ok:
                # A peer's crash often surfaces first as a collective error on a survivor:
                # give the crashed rank a moment to be seen, and name every rank that raised.
                time.sleep(1.0)
                raised = [(rank, value), *_more_failures(results)]
                raise WorkerFailure(_deaths(processes, [r for r, _ in raised]) + "".join(
                    f"rank {r} raised:\n{text}" for r, text in raised))
            collected[rank] = value
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _kill(processes)
    return [collected[rank] for rank in range(world_size)]


@dataclass
class ScriptRun:
    """What a torchrun launch left behind."""

    returncode: int
    output: str
    seconds: float


PR_SET_CHILD_SUBREAPER = 36


def _adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans (Linux), so that what a launch
    leaves behind stays findable: torchrun starts each rank in a session of its own, and a rank
    killed mid-save orphans its checkpoint writer, which would otherwise outlive the test."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def run_python(code: str, *, timeout: float = 120.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter running ``code`` in the repository root (what a new process imports,
    or refuses, before anything else), its output captured as text."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def start_session(command: Sequence[str], **popen: Any) -> tuple[subprocess.Popen, float]:
    """Launch ``command`` in a session of its own; returns it and its start time for
    :func:`kill_session`."""
    _adopt_orphans()
    started = time.time()
    return subprocess.Popen(command, start_new_session=True, **popen), started


def kill_session(process: subprocess.Popen, started: float) -> None:
    """Kill everything a ``start_new_session`` launch made since ``started`` (a
    ``time.time()``): the launcher's group, and every descendant it left behind."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.create_time() >= started:
                child.kill()
                child.wait(timeout=10)


def run_script(script: str | Path, argv: Sequence[str], nproc: int, *, timeout: float = 110.0,
               env: dict[str, str] | None = None, cwd: str | Path = REPO_ROOT) -> ScriptRun:
    """Launch ``script`` under ``torchrun --nproc-per-node nproc``; kill the whole tree on timeout."""
    command = torchrun_command(script, nproc, list(argv))
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.monotonic()
    process, started = start_session(command, cwd=cwd, env=child_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process, started)
        output, _ = process.communicate()
        raise WorkerFailure(
            f"{script} with {nproc} processes ran past {timeout:.0f} s (killed); output tail:\n"
            f"{output[-4000:]}"
        ) from None
    finally:
        kill_session(process, started)
    return ScriptRun(process.returncode, output, time.monotonic() - start)


def _run_script_rank(script: str, argv: Sequence[str], variables: dict[str, str],
                     env: dict[str, str], log: str) -> None:
    """One rank of :func:`launch_preforked`: torchrun's environment, output appended to ``log``
    line by line, then the script as ``python script argv`` would run it."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(variables)
    _torchrun_threads()  # the server's pool was sized when it started
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    sys.argv = [script, *argv]
    # As ``python script`` starts: the script's folder first, then PYTHONPATH's entries.
    sys.path[:0] = [str(Path(script).parent),
                    *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


PRELOADED_ENVIRONMENT = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "MKL_NUM_THREADS")
"""Variables torch's libraries read once, when they load: a preforked rank keeps the server's."""


_variant_servers: dict[tuple[tuple[str, str | None], ...], forkserver.ForkServer] = {}
"""Preloaded servers by the values of :data:`PRELOADED_ENVIRONMENT` they started under."""


def _variant_server(preloaded: tuple[tuple[str, str | None], ...]) -> forkserver.ForkServer:
    """A second preloaded server (:mod:`tests.harness.simulation_preload`) whose torch loaded
    under ``preloaded`` (another kernel dispatch, say), started once: a fork of the usual server
    would keep that server's kernels whatever its environment says."""
    if preloaded not in _variant_servers:
        server = forkserver.ForkServer()
        server.set_forkserver_preload([SIMULATION_PRELOAD])
        saved = dict(os.environ)
        try:
            for name, value in preloaded:
                os.environ.pop(name, None)
                if value is not None:
                    os.environ[name] = value
            server.ensure_running()  # the server inherits this environment
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _variant_servers[preloaded] = server
    return _variant_servers[preloaded]


@contextlib.contextmanager
def _forking_from(server: forkserver.ForkServer) -> Any:
    """Processes started inside fork from ``server``, not the forkserver context's own (which
    ``multiprocessing.popen_forkserver`` asks for by this module attribute)."""
    usual = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = usual


def _kill_trees(processes: Sequence[mp.Process]) -> None:
    """Kill ranks and whatever they started (a spawned Manager, loader workers)."""
    for process in processes:
        if process.pid is None:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
    _kill(processes)


def launch_preforked(script: str | Path, argv: Sequence[str], nproc: int, *, env: dict[str, str],
                     log: Path, timeout: float, world_size: int | None = None) -> int:
    """Run ``script argv`` on ``nproc`` ranks as torchrun would (its rank variables, every rank's
    output to ``log``, the first failure ending the others); the exit code, 0 when every rank
    succeeded. Each rank is a fork of the simulation's preloaded server, so it skips the ~10 s
    of CPU that importing torch and Megatron costs; only for ``--cpu-simulation`` runs. Where
    ``env`` gives :data:`PRELOADED_ENVIRONMENT` other values than this process has, the ranks are
    forks of a server of their own, started under those values (:func:`_variant_server`).
    ``world_size`` above ``nproc``: the ranks are told of peers never started, so a process group
    could not form (a launch whose ranks must stop before one)."""
    if "--cpu-simulation" not in argv:
        raise ValueError("launch_preforked runs --cpu-simulation scripts; use torchrun")
    preloaded = tuple((name, env.get(name)) for name in PRELOADED_ENVIRONMENT)
    variant = any(value != os.environ.get(name) for name, value in preloaded)
    context = _context(simulated=True)
    store = rendezvous_store()
    log.write_text("")
    processes = [
        context.Process(target=_run_script_rank,
                        args=(str(script), tuple(argv),
                              torchrun_variables(rank, world_size or nproc, store),
                              env, str(log)))
        for rank in range(nproc)
    ]
    with _forking_from(_variant_server(preloaded)) if variant else contextlib.nullcontext():
        for process in processes:
            process.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [process.exitcode for process in processes]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                with log.open("a") as out:
                    out.write(f"launch_preforked: rank {rank} exited with code {code}; the other "
                              "ranks are killed\n")
                return code if code > 0 else 1
            if all(code == 0 for code in codes):
                return 0
            if time.monotonic() > deadline:
                raise TimeoutError(f"{script} with {nproc} ranks ran past {timeout:.0f} s")
            time.sleep(0.1)
    finally:
        _kill_trees(processes)


def run_preforked(script: str | Path, argv: Sequence[str], nproc: int, *,
                  timeout: float, env: dict[str, str] | None = None,
                  world_size: int | None = None) -> ScriptRun:
    """:func:`launch_preforked` in this process's environment updated by ``env``, answered as
    :func:`run_script` answers (exit code, every rank's output, seconds); for launches whose
    point is what the ranks print or save, not torchrun's own handling."""
    start_simulation_server()
    with tempfile.TemporaryDirectory(prefix="preforked-") as folder:
        log = Path(folder) / "launch.log"
        start = time.monotonic()
        code = launch_preforked(script, argv, nproc, env={**os.environ, **(env or {})}, log=log,
                                timeout=timeout, world_size=world_size)
        return ScriptRun(code, log.read_text(), time.monotonic() - start)
