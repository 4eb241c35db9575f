"""Which training errors re-form the group in-process and which take the restart path
(:func:`elastic_train.train.hot.classify_failure`), on the texts torch 2.13 and NCCL produce.

The NCCL texts are built the way torch builds them: ``C10D_NCCL_CHECK`` (NCCLUtils.hpp) raises
``DistBackendError("NCCL error in: FILE:LINE, <ncclGetErrorWithVersion>\\n<getNcclErrorDetailStr>")``; the
watchdog's timeout is ``WorkNCCL::checkTimeout``'s "Watchdog caught collective operation timeout"; an aborted
communicator is ``checkForNCCLErrorsInternal``'s "NCCL communicator was aborted on rank N."; CUDA errors are
c10's ``C10_CUDA_CHECK`` "CUDA error: <cudaGetErrorString>".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_train.envvars import ENV_NODE_DIR
from elastic_train.node import AgentChannel, Assignment
from elastic_train.train.env import WorkerEnv
from elastic_train.train.group import ENV_NCCL_ERROR_HANDLING, NCCL_CLEAN_UP_ONLY, World, nccl_error_handling
from elastic_train.train.hot import (
    Failure,
    GroupChanged,
    Reformer,
    RunEnded,
    classify_failure,
    group_failure,
    request_next_round,
    run,
)
from elastic_train.train.link import ProcessLink, use_process_link

PG = "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"
PREFIX = "[PG ID 0 PG GUID 0(default_pg) Rank 1] "


def nccl(result: str, detail: str, last: str = "") -> RuntimeError:
    text = f"NCCL error in: {PG}:2183, {result}, NCCL version 2.27.5\n{detail}"
    if last:
        text += f"\nLast error:\n{last}"
    return dist.DistBackendError(text)


REMOTE = nccl(
    "remote process exited or there was a network error",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
    "socketProgress: Connection closed by remote peer 127.0.0.1<43110>",
)
SYSTEM = nccl(
    "unhandled system error (run with NCCL_DEBUG=INFO for details)",
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. "
    "It can be also caused by unexpected exit of a remote peer.",
)
TIMEOUT = dist.DistBackendError(
    f"{PREFIX}Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, "
    "NumelIn=4096, NumelOut=4096, Timeout(ms)=600000) ran for 600011 milliseconds before timing out."
)
ABORTED = dist.DistBackendError(f"{PREFIX}NCCL communicator was aborted on rank 1.")
WATCHDOG = dist.DistBackendError(
    f"{PREFIX}Process group watchdog thread terminated with exception: NCCL error: remote process exited "
    "or there was a network error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a "
    "network error or a remote process exiting prematurely."
)
ILLEGAL = RuntimeError(
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
    "reported at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider "
    "passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
)
LAUNCH = RuntimeError("CUDA error: unspecified launch failure")
ECC = RuntimeError("CUDA error: uncorrectable ECC error encountered")
NCCL_CUDA = nccl(
    "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    "ncclUnhandledCudaError: Call to CUDA function failed.",
    "Cuda failure 700 'an illegal memory access was encountered'",
)
#: A remote error whose last error is a CUDA failure on this device: the device, not the peer, is the problem.
REMOTE_CUDA = nccl(
    "remote process exited or there was a network error",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
    "Cuda failure 'unspecified launch failure'",
)
USAGE = nccl(
    "invalid usage (run with NCCL_DEBUG=INFO for details)",
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.",
)


@pytest.mark.parametrize(
    "exc",
    [REMOTE, SYSTEM, TIMEOUT, ABORTED, WATCHDOG],
    ids=["remote", "system", "timeout", "aborted", "watchdog"],
)
def test_a_broken_nccl_group_re_forms_in_process(exc: BaseException) -> None:
    failure = classify_failure(exc)
    assert failure is not None and failure.reform, failure
    assert failure.reason and "\n" not in failure.reason
    assert group_failure(exc) == failure.reason


@pytest.mark.parametrize(
    "exc",
    [ILLEGAL, LAUNCH, ECC, NCCL_CUDA, REMOTE_CUDA],
    ids=["illegal", "launch", "ecc", "nccl-cuda", "remote-cuda"],
)
def test_a_poisoned_cuda_context_takes_the_restart_path(exc: BaseException) -> None:
    failure = classify_failure(exc)
    assert failure is not None and not failure.reform
    assert failure.reason.startswith("CUDA context unusable: ")
    assert group_failure(exc) is None  # the exception propagates: the worker exits, torchrun restarts it


def test_poison_anywhere_in_the_chain_wins_over_a_broken_group() -> None:
    """The watchdog's remote error seen first, a CUDA error behind it: still a new process."""
    try:
        try:
            raise ILLEGAL
        except RuntimeError as exc:
            raise REMOTE from exc
    except RuntimeError as chained:
        assert classify_failure(chained) == Failure(
            False, "CUDA context unusable: " + str(ILLEGAL).splitlines()[0]
        )


def test_other_errors_are_not_group_failures() -> None:
    assert classify_failure(USAGE) is None  # a bug in the collective's use: re-forming would repeat it
    assert classify_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    # torch >= 2.8 raises CUDA errors as AcceleratorError (a RuntimeError): the text decides, not the type
    assert classify_failure(torch.AcceleratorError("CUDA error: misaligned address")) == Failure(
        False, "CUDA context unusable: CUDA error: misaligned address"
    )
    assert classify_failure(GroupChanged("round 3")) == Failure(True, "membership change announced")


def test_nccl_error_handling_is_clean_up_only_under_a_re_forming_agent() -> None:
    env: dict[str, str] = {}
    nccl_error_handling(env, reform=False)
    assert ENV_NCCL_ERROR_HANDLING not in env  # hot recovery off: torch's default
    nccl_error_handling(env, reform=True)
    assert env[ENV_NCCL_ERROR_HANDLING] == NCCL_CLEAN_UP_ONLY
    env = {ENV_NCCL_ERROR_HANDLING: "3"}
    nccl_error_handling(env, reform=True)
    assert env[ENV_NCCL_ERROR_HANDLING] == "3"  # the user's choice stays (and register() restarts instead)


def start_assignment(round_: int, **kw: Any) -> Assignment:
    return Assignment(round=round_, node_rank=0, nodes=1, master_addr="127.0.0.1", master_port=29500, **kw)


def link_in(directory: Path, assignment: Assignment) -> ProcessLink:
    """The link of a worker whose agent published ``assignment`` in ``directory``."""
    AgentChannel(str(directory)).assign(assignment)
    return ProcessLink.from_environ({ENV_NODE_DIR: str(directory), "LOCAL_RANK": "0"})


@pytest.mark.parametrize(("mode", "registers"), [(NCCL_CLEAN_UP_ONLY, True), ("3", False), (None, False)])
def test_an_nccl_group_re_forms_in_process_only_in_clean_up_only_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str | None, registers: bool
) -> None:
    if mode is None:
        monkeypatch.delenv(ENV_NCCL_ERROR_HANDLING, raising=False)
    else:
        monkeypatch.setenv(ENV_NCCL_ERROR_HANDLING, mode)
    link = link_in(tmp_path, start_assignment(4, reform=True))
    env = WorkerEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, link.assignment)
    world = World(
        rank=1, world_size=2, local_rank=0, local_world_size=1, device=torch.device("cuda", 0),
        backend="nccl", round=4, run_id="r", restart_count=0,
    )  # fmt: skip
    Reformer(link, env, "nccl").register(world)
    ready = AgentChannel(str(tmp_path)).ready()
    assert {r: m.round for r, m in ready.items()} == ({0: 4} if registers else {})


def test_shutdown_aborts_an_nccl_group_before_destroying_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL: abort first (destroy's finalize would wait on a dead peer); gloo: destroy as before. The group
    here is gloo; the backend it reports is what shutdown() goes by."""
    from elastic_train.net import free_port
    from elastic_train.train import group

    calls: list[str] = []
    real_abort = group._abort_nccl
    for backend in ("gloo", "nccl"):
        calls.clear()
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1
        )
        monkeypatch.setattr(group, "_backend_of_default_group", lambda b=backend: b)
        monkeypatch.setattr(group, "_abort_nccl", lambda: (calls.append("abort"), real_abort()))
        monkeypatch.setattr(dist, "destroy_process_group", _recording(calls, dist.destroy_process_group))
        group.shutdown()
        monkeypatch.undo()
        assert not dist.is_initialized()
        assert calls == (["abort"] if backend == "nccl" else ["destroy"])


def _recording(calls: list[str], fn: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append("destroy")
        return fn(*args, **kwargs)

    return wrapped


def test_only_a_broken_group_is_re_formed_in_process() -> None:
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1455: "
        "Connection reset by peer"
    )
    assert group_failure(gloo) is not None
    try:
        try:
            raise gloo
        except RuntimeError as exc:
            raise ValueError("a checkpoint write failed") from exc
    except ValueError as wrapped:
        assert group_failure(wrapped) is not None  # the cause counts
    assert group_failure(GroupChanged("round 3")) == "membership change announced"
    assert group_failure(RuntimeError("shapes do not match")) is None  # the user's own error
    assert group_failure(KeyError("x")) is None


def test_a_worker_re_forms_only_under_an_agent_that_re_forms(tmp_path: Path) -> None:
    env = WorkerEnv.from_environ({})
    assert Reformer.of(ProcessLink(None), env) is None  # not under an etcd3 agent
    (tmp_path / "off").mkdir()
    off = link_in(tmp_path / "off", start_assignment(3))  # hot recovery off
    assert Reformer.of(off, WorkerEnv.from_environ({}, off.assignment)) is None
    on = link_in(tmp_path, start_assignment(3, reform=True))
    assert Reformer.of(on, WorkerEnv.from_environ({}, on.assignment)) is not None


def test_a_standby_worker_exits_0_when_its_run_ended_before_admission(tmp_path: Path) -> None:
    link = link_in(tmp_path, start_assignment(3, standby_s=30.0, reform=True))
    env = WorkerEnv.from_environ({}, link.assignment)
    reformer = Reformer.of(link, env)
    assert reformer is not None and reformer.standby == 30.0
    AgentChannel(str(tmp_path)).end("run r finished")
    called: list[Any] = []
    use_process_link(link)
    try:
        with pytest.raises(RunEnded) as ended:
            run(called.append, env)
    finally:
        use_process_link(None)
    assert ended.value.code == 0 and ended.value.message == "run r finished" and called == []
    assert AgentChannel(str(tmp_path)).standbys()[0].round == 3


def test_a_broken_group_asks_for_the_next_round_on_the_way_out(tmp_path: Path) -> None:
    link = link_in(tmp_path, start_assignment(5, reform=True))
    agent = AgentChannel(str(tmp_path))
    broken = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:29400: Connection reset by peer"
    )
    use_process_link(link)
    try:
        request_next_round(broken)
        assert agent.requests() == {}, "not registered: the agent restarts this worker, nothing to ask"
        link.registered = True
        request_next_round(RuntimeError("shapes do not match"))  # the user's own error: the restart path
        request_next_round(RuntimeError("CUDA error: an illegal memory access was encountered"))
        assert agent.requests() == {}
        request_next_round(broken)
        asked = agent.requests()[0]
        assert (asked.round, asked.reason) == (5, group_failure(broken))
        request_next_round(GroupChanged("round 5 re-forms after step 7"))  # an announced change: asked too
        assert agent.requests()[0].reason == "membership change announced"
    finally:
        use_process_link(None)
