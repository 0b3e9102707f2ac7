"""Runners for the Step tests: the same operations through the unary RPCs or as Step
items, with answers normalised so that the two can be compared (node and lock ids
renumbered, server_epoch and the model's name left out)."""

from __future__ import annotations

import re
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import text_format
from harness import pb

Scenario = Callable[[str], Generator[tuple[str, dict[str, Any]], Any, None]]


@dataclass(frozen=True)
class Err:
    code: str
    message: str


def _tail(kind: str, reply: Any, request: dict[str, Any]) -> bytes:
    """The slots a finish frees after its insert."""
    if kind == "s":
        return request["slot_indices"]
    return request["slot_indices"][8 * reply.cached_len :]


class Runner:
    """Runs a scenario's operations on one model, in a session of its own."""

    def __init__(self, stub: Any, model: str) -> None:
        self.stub, self.model, self.kind = stub, model, model[0]
        stub.Reset(pb.ResetRequest(model=model))
        self.sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        self.other = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        self._ids: dict[tuple[str, int], int] = {}

    def __call__(self, op: str, **params: Any) -> Any:
        if op == "alloc_other":  # setup: slots of somebody else
            return self.stub.Alloc(
                pb.AllocRequest(model=self.model, session_id=self.other, **params)
            )
        try:
            return self.run(op, params)
        except grpc.RpcError as exc:
            return Err(exc.code().name, exc.details())

    def run(self, op: str, params: dict[str, Any]) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        for sid in (self.sid, self.other):
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))

    def stats(self) -> str:
        stats = self.stub.Stats(pb.StatsRequest(model=self.model)).models[0]
        stats.model = ""
        return text_format.MessageToString(stats, as_one_line=True)

    def norm(self, result: Any) -> Any:
        if isinstance(result, Err):
            message = result.message.replace(repr(self.model), "<model>")
            return result.code, re.sub(r"\d{12,}", "<id>", message)
        msg = type(result)()
        msg.CopyFrom(result)
        fields = msg.DESCRIPTOR.fields_by_name
        if "server_epoch" in fields:
            msg.server_epoch = 0
        for name in ("node_id", "lock_id"):
            if name in fields and getattr(msg, name):
                # Node and lock ids are separate namespaces (they may be equal numbers).
                key = (name, getattr(msg, name))
                setattr(msg, name, self._ids.setdefault(key, len(self._ids) + 1))
        return type(msg).__name__, text_format.MessageToString(msg, as_one_line=True)


class Unary(Runner):
    def run(self, op: str, params: dict[str, Any]) -> Any:
        s, model, sid = self.stub, self.model, self.sid
        if op == "match":
            return s.Match(pb.MatchRequest(model=model, session_id=sid, **params))
        if op in ("insert", "finish"):
            reply = s.Insert(pb.InsertRequest(model=model, session_id=sid, **params))
            if op == "finish" and (tail := _tail(self.kind, reply, params)):
                s.Free(pb.FreeRequest(model=model, session_id=sid, slot_indices=tail))
            return reply
        if op == "alloc":
            return s.Alloc(pb.AllocRequest(model=model, session_id=sid, **params))
        if op == "free":
            return s.Free(pb.FreeRequest(model=model, session_id=sid, **params))
        if op == "unlock":
            return s.Unlock(pb.UnlockRequest(session_id=sid, **params))
        raise ValueError(op)


class Stepped(Runner):
    def run(self, op: str, params: dict[str, Any]) -> Any:
        request = pb.StepRequest(model=self.model, session_id=self.sid)
        if op == "match":
            request.admits.add(**params)
        elif op in ("insert", "finish"):
            request.finishes.add(keep_tail=op == "insert", **params)
        elif op == "alloc":
            request.decodes.append(params.pop("num_slots"))
        elif op == "free":
            request.frees.add(**params)
        elif op == "unlock":
            request.unlocks.append(params["lock_id"])
        reply = self.stub.Step(request)
        (result,) = [*reply.finishes, *reply.unlocks, *reply.frees, *reply.decodes, *reply.admits]
        if result.HasField("error"):
            return Err(CODES[result.error.code].name, result.error.message)
        assert reply.counters.model == self.model
        return getattr(result, result.WhichOneof("result"))


CODES = {code.value[0]: code for code in grpc.StatusCode}


def drive(scenario: Scenario, runner: Runner) -> list[Any]:
    """Every operation's normalised answer and the counters after it."""
    trace = []
    gen = scenario(runner.kind)
    try:
        op, params = next(gen)
        while True:
            result = runner(op, **params)
            trace.append((op, runner.norm(result), runner.stats()))
            op, params = gen.send(result)
    except StopIteration:
        pass
    runner.close()
    trace.append(("closed", runner.stats()))
    return trace


LISTS = ("finishes", "unlocks", "frees", "decodes", "admits")


def unary_step(runner: Unary, step: pb.StepRequest) -> dict[str, list[Any]]:
    """A step's items as the unary calls, one by one, in the step's order."""

    def fields(item: Any) -> dict[str, Any]:
        return {f.name: v for f, v in item.ListFields() if f.name != "keep_tail"}

    out: dict[str, list[Any]] = {name: [] for name in LISTS}
    for f in step.finishes:
        out["finishes"].append(runner("insert" if f.keep_tail else "finish", **fields(f)))
    for lock_id in step.unlocks:
        out["unlocks"].append(runner("unlock", lock_id=lock_id))
    for f in step.frees:
        out["frees"].append(runner("free", **fields(f)))
    for n in step.decodes:
        out["decodes"].append(runner("alloc", num_slots=n))
    for a in step.admits:
        out["admits"].append(
            runner("match", **{k: v for k, v in fields(a).items() if k != "expected_prefix_len"})
        )
    return out


def stepped_step(runner: Stepped, step: pb.StepRequest) -> dict[str, list[Any]]:
    """A step's items in one Step call."""
    request = pb.StepRequest()
    request.CopyFrom(step)
    request.model, request.session_id = runner.model, runner.sid
    reply = runner.stub.Step(request)
    return {
        name: [
            Err(CODES[r.error.code].name, r.error.message)
            if r.HasField("error")
            else getattr(r, r.WhichOneof("result"))
            for r in getattr(reply, name)
        ]
        for name in LISTS
    }
