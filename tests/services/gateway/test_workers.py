"""The gateway's worker clients on every wire, against real target and draft processes.

On the ``stream`` wire a sequence's steps share one bidirectional gRPC stream, on the ``socket``
wire one connection to the worker's step socket; either way a step that fails or misses its
timeout must fail exactly as the unary call does, drop its stream or connection (a late response
must never be read as the next step's), and leave other sequences' alone.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np
import pytest

from services.gateway.workers import DraftClient, StepStream, TargetClient, budget_vote_pb
from services.target.server import budget_vote_from_pb
from splitspec.spec.budget_choice import BudgetVote
from splitspec.transport.tensors import array_from_pb
from splitspec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.worker_steps import BAD_TREE, PROMPT, TREES, client_on, prefill, run, steps

pytestmark = pytest.mark.slow

ORACLE_DELAY_S = 0.4


@pytest.fixture(scope="module")
def workers(module_services, tiny_pair, tmp_path_factory):
    s = module_services
    model = str(tiny_pair.target)
    table = tmp_path_factory.mktemp("oracle") / "table.jsonl"
    table.write_text("")
    target = s.start("w-target", "target", "--model", model, "--dtype", "float64", "--threads", "1")
    slow = s.start("w-slow", "oracle-draft", "--table", str(table), "--delay", str(ORACLE_DELAY_S), "--target-model", model)
    return {"target": target, "slow": slow}


STREAMED_WIRES = ["stream", "socket"]


def carrier(client, sequence_id: str):
    """The gRPC call or the socket connection a sequence's steps ride on (None once dropped)."""
    stream = client._streams[sequence_id]
    return stream._call if isinstance(stream, StepStream) else stream._writer


@pytest.mark.parametrize("wire", STREAMED_WIRES)
def test_streamed_steps_equal_unary_steps_and_share_one_carrier(workers, wire):
    async def scenario():
        streamed, unary = await client_on(wire, TargetClient, workers["target"]), TargetClient(workers["target"], wire="unary")
        try:
            await prefill(streamed, "s-stream")
            await prefill(unary, "s-unary")
            first = await steps(streamed, "s-stream", TREES[:1])
            call = carrier(streamed, "s-stream")
            got = first + await steps(streamed, "s-stream", TREES[1:])
            assert carrier(streamed, "s-stream") is call  # every step rode the same stream or connection
            want = await steps(unary, "s-unary", TREES)
            assert got == want
            await streamed.release("s-stream")
            assert "s-stream" not in streamed._streams and (call.cancelled() if wire == "stream" else call.is_closing())
            await unary.release("s-unary")
        finally:
            await streamed.close()
            await unary.close()

    run(scenario())


@pytest.mark.parametrize("wire", [*STREAMED_WIRES, "unary"])
def test_pipelined_decode_steps_equal_one_at_a_time_steps(workers, wire):
    """``TargetClient.decode``: target-only steps with two requests in flight (one at a time on
    unary) commit what verify steps of no node commit one by one; stopping with a request in
    flight drops the stream, so the next step reads its own answer, not the abandoned one's."""
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))

    sid, ref = f"decoded-{wire}", f"one-by-one-{wire}"

    async def scenario():
        client, reference = await client_on(wire, TargetClient, workers["target"]), TargetClient(workers["target"], wire="unary")
        try:
            await prefill(client, sid)
            await prefill(reference, ref)
            want = await steps(reference, ref, [empty] * 12)
            got = [(v.committed_tokens, v.next_token, v.committed_length) async for v in client.decode(sid, 6, lambda: 30)]
            assert [g[:2] for g in got] == want[:6]
            assert [g[2] for g in got] == list(range(len(PROMPT) + 1, len(PROMPT) + 7))
            carried = carrier(client, sid) if wire != "unary" else None
            async with contextlib.aclosing(client.decode(sid, 3, lambda: 30)) as decoded:
                async for v in decoded:
                    assert (v.committed_tokens, v.next_token) == want[6]
                    break  # the second request is in flight: it runs at the target (or leaves its queue); its answer is dropped
            if wire != "unary":
                assert carrier(client, sid) is None and (carried.done() if wire == "stream" else carried.is_closing())
            after = await client.verify(sid, *empty, False, timeout=30)
            # Unclosed, the generator leaves its answer unread until collected: the next step opens a new stream.
            left = client.decode(sid, 2, lambda: 30)
            await anext(left)
            later = await client.verify(sid, *empty, False, timeout=30)
            assert later.committed_length - after.committed_length in ((2,) if wire == "unary" else (2, 3))
            assert (later.committed_tokens, later.next_token) == want[later.committed_length - len(PROMPT) - 1]
            await left.aclose()
            ran = after.committed_length - len(PROMPT) - 1  # steps before this one: 7, or 8 if the dropped one ran
            assert ran in ((7,) if wire == "unary" else (7, 8)) and (after.committed_tokens, after.next_token) == want[ran]
            await client.release(sid)
            await reference.release(ref)
        finally:
            await client.close()
            await reference.close()

    run(scenario())


@pytest.mark.parametrize("wire", [*STREAMED_WIRES, "unary"])
def test_pipelined_decode_steps_return_the_features_of_one_at_a_time_steps(workers, wire):
    """The adaptive budget's target-only runs ask ``TargetClient.decode`` for each step's tap
    features (the draft's next proposal takes them): pipelined, each answer carries its own row's,
    as a verify step of no node does one by one."""
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    sid, ref = f"decoded-features-{wire}", f"one-by-one-features-{wire}"

    async def tapped(client, sequence_id):
        request = target_pb2.PrefillRequest(sequence_id=sequence_id, tokens=PROMPT, reserve_tokens=128, tap_layer_ids=[0, 1])
        return await client.prefill(request, timeout=30)

    async def scenario():
        client, reference = await client_on(wire, TargetClient, workers["target"]), TargetClient(workers["target"], wire="unary")
        try:
            width = array_from_pb((await tapped(client, sid)).features).shape[1]  # both taps' hidden states
            await tapped(reference, ref)
            want = [await reference.verify(ref, *empty, True, timeout=30) for _ in range(5)]
            got = [v async for v in client.decode(sid, 5, lambda: 30, return_features=True, late_last=True)]
            assert [(g.committed_tokens, g.next_token) for g in got] == [(w.committed_tokens, w.next_token) for w in want]
            for g, w in zip(got, want):
                assert array_from_pb(g.features).shape == (1, width)
                np.testing.assert_array_equal(array_from_pb(g.features), array_from_pb(w.features))
            plain = [v async for v in client.decode(sid, 2, lambda: 30)]
            assert all(v.features is None for v in plain)  # none asked for, none sent
            await client.release(sid)
            await reference.release(ref)
        finally:
            await client.close()
            await reference.close()

    run(scenario())


@pytest.mark.parametrize("wire", STREAMED_WIRES)
def test_malformed_tree_mid_stream_fails_like_unary_and_spares_other_sequences(workers, wire):
    async def scenario():
        streamed, unary = await client_on(wire, TargetClient, workers["target"]), TargetClient(workers["target"], wire="unary")
        try:
            for sid in ("bad", "other"):
                await prefill(streamed, sid)
            await prefill(unary, "reference")
            want = await steps(unary, "reference", TREES)
            assert await steps(streamed, "bad", TREES[:1]) == want[:1]
            assert await steps(streamed, "other", TREES[:1]) == want[:1]
            broken = carrier(streamed, "bad")

            async def bad_step():
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await streamed.verify("bad", *BAD_TREE, False, timeout=30)
                return failed.value

            error, other = await asyncio.gather(bad_step(), steps(streamed, "other", TREES[1:]))
            assert other == want[1:]  # the other sequence's stream or connection went on untouched
            with pytest.raises(grpc.aio.AioRpcError) as unary_error:
                await unary.verify("reference", *BAD_TREE, False, timeout=30)
            assert error.code() == unary_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == unary_error.value.details() == "parents[1] = 5 is not in [0, 1]"
            # The bad request changed nothing: the sequence goes on, on a new stream or connection.
            assert await steps(streamed, "bad", TREES[1:]) == want[1:]
            assert carrier(streamed, "bad") is not broken and (broken.done() if wire == "stream" else broken.is_closing())
            for sid in ("bad", "other"):
                await streamed.release(sid)
            await unary.release("reference")
        finally:
            await streamed.close()
            await unary.close()

    run(scenario())


def test_a_stream_serves_one_sequence(workers, tiny_pair):
    """A request naming another sequence ends the stream with INVALID_ARGUMENT, on both workers."""
    with grpc.insecure_channel(workers["target"]) as ch:
        stub = target_pb2_grpc.TargetWorkerStub(ch)
        for sid in ("one", "two"):
            stub.Prefill(target_pb2.PrefillRequest(sequence_id=sid, tokens=PROMPT, reserve_tokens=64), timeout=30)
        responses = stub.VerifyStream(iter([target_pb2.VerifyRequest(sequence_id=sid) for sid in ("one", "one", "two")]), timeout=30)
        assert next(responses).committed_length == len(PROMPT) + 1
        assert next(responses).committed_length == len(PROMPT) + 2
        with pytest.raises(grpc.RpcError) as mixed:
            next(responses)
        assert mixed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert mixed.value.details() == "sequence_id: 'two' on the stream of sequence 'one' (one stream per sequence)"
        for sid in ("one", "two"):
            stub.Release(common_pb2.ReleaseRequest(sequence_id=sid), timeout=10)
    with grpc.insecure_channel(workers["slow"]) as ch:
        requests = [
            draft_pb2.ProposeRequest(sequence_id=sid, anchor_token=1, anchor_position=len(PROMPT), tokens=PROMPT, top_k=2)
            for sid in ("p", "q")
        ]
        responses = draft_pb2_grpc.DraftWorkerStub(ch).ProposeStream(iter(requests), timeout=30)
        assert next(responses).top_ids.shape == [15, 2]
        with pytest.raises(grpc.RpcError) as mixed:
            next(responses)
        assert mixed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'q' on the stream of sequence 'p'" in mixed.value.details()
        draft_pb2_grpc.DraftWorkerStub(ch).Release(common_pb2.ReleaseRequest(sequence_id="p"), timeout=10)


def test_undecodable_message_mid_stream_is_invalid_argument(workers):
    """The error interceptor checks every message of a stream, as it checks a unary request."""
    with grpc.insecure_channel(workers["target"]) as ch:
        target_pb2_grpc.TargetWorkerStub(ch).Prefill(
            target_pb2.PrefillRequest(sequence_id="raw", tokens=PROMPT, reserve_tokens=64), timeout=30
        )
        verify_stream = ch.stream_stream("/splitspec.v1.TargetWorker/VerifyStream")  # bytes in, bytes out
        good = target_pb2.VerifyRequest(sequence_id="raw").SerializeToString()
        invalid_utf8 = b"\x0a\x01\xff"  # field 1 (sequence_id, a string) holding byte 0xff
        responses = verify_stream(iter([good, invalid_utf8]), timeout=30)
        assert target_pb2.VerifyResponse.FromString(next(responses)).committed_length == len(PROMPT) + 1
        with pytest.raises(grpc.RpcError) as undecodable:
            next(responses)
        assert undecodable.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert undecodable.value.details().startswith("request is not a valid /splitspec.v1.TargetWorker/VerifyStream message")
        target_pb2_grpc.TargetWorkerStub(ch).Release(common_pb2.ReleaseRequest(sequence_id="raw"), timeout=10)


@pytest.mark.parametrize("wire", STREAMED_WIRES)
def test_draft_step_past_its_timeout_drops_the_stream(workers, wire):
    """A propose that misses its timeout raises DEADLINE_EXCEEDED as the unary call does; its late
    response is never read: the next step, on a new stream, gets its own answer (top_k 3, not 2)."""

    async def scenario():
        draft = await client_on(wire, DraftClient, workers["slow"])
        unary = DraftClient(workers["slow"], wire="unary")
        try:
            for client, sid in ((draft, "late"), (unary, "late-unary")):
                with pytest.raises(grpc.aio.AioRpcError) as missed:
                    await client.propose(sid, 1, len(PROMPT), PROMPT, None, 2, 0, timeout=0.05)
                assert missed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert missed.value.details() == "Deadline Exceeded"
            assert carrier(draft, "late") is None  # dropped at once, not left for the late response
            await asyncio.sleep(2 * ORACLE_DELAY_S)  # both late proposals ran on the worker
            await draft.release("late")  # as the gateway does after a failed draft step
            await unary.release("late-unary")
            top_ids = (await draft.propose("late", 1, len(PROMPT), PROMPT, None, 3, 0, timeout=10)).top_ids
            assert top_ids.shape == (15, 3)
            top_ids = (await draft.propose("late", 2, len(PROMPT) + 1, [1], None, 3, 0, timeout=10)).top_ids
            assert top_ids.shape == (15, 3)
            await draft.release("late")
        finally:
            await draft.close()
            await unary.close()

    run(scenario())


@pytest.mark.parametrize("wire", STREAMED_WIRES)
def test_a_step_in_flight_cannot_bring_back_a_released_context(workers, wire):
    """The gateway gives up on a context's step, releases the context, and the step then runs: it is
    refused (the draft keeps no context for the sequence) and the next context starts cleanly.
    With other sequences live the steps run on the draft's engine thread, so the release, answered
    on its event loop, overtakes the late step, as it does under load."""

    async def scenario():
        draft = await client_on(wire, DraftClient, workers["slow"])
        try:
            busy, gone = [f"{wire}-busy", f"{wire}-busier"], f"{wire}-gone"  # ids are remembered across tests
            for sid in busy:
                await draft.propose(sid, 1, len(PROMPT), PROMPT, None, 2, 0, timeout=10, context=1)
            with pytest.raises(grpc.aio.AioRpcError) as missed:
                await draft.propose(gone, 1, len(PROMPT), PROMPT, None, 2, 0, timeout=0.05, context=1)
            assert missed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await draft.release(gone, 1)  # while the late step still runs
            await asyncio.sleep(2 * ORACLE_DELAY_S)  # it has run by now
            assert (await draft.info(timeout=10)).live_sequences == 2  # the busy ones only
            top_ids = (await draft.propose(gone, 1, len(PROMPT), PROMPT, None, 3, 0, timeout=10, context=2)).top_ids
            assert top_ids.shape == (15, 3)
            with pytest.raises(grpc.aio.AioRpcError) as stale:
                await draft.propose(gone, 1, len(PROMPT) + 1, [1], None, 3, 0, timeout=10, context=1)
            assert stale.value.code() == grpc.StatusCode.ABORTED
            assert stale.value.details() == f"context 1 of sequence '{gone}' was released; start context 2 or later"
            for sid, number in ((busy[0], 1), (busy[1], 1), (gone, 2)):
                await draft.release(sid, number)
        finally:
            await draft.close()

    run(scenario())


def test_the_target_agrees_one_budget_over_the_gateways_votes_on_every_wire(workers):
    """Votes ride the steps of any wire (``VerifyRequest.budget_vote``) and every answer carries the
    budget the target agreed over them (``VerifyResponse.agreed_budget``), the same on every wire;
    a malformed vote fails its step with INVALID_ARGUMENT and leaves the sequence as it was."""
    budgets = np.array([0, 3, 7, 15])
    alone = BudgetVote("gateway-a", budgets, np.array([10.0, 30.0, 28.0, 20.0]), 2)  # alone: 3
    crowd = BudgetVote("gateway-b", budgets, np.array([10.0, 20.0, 40.0, 30.0]), 6)  # with it: 7
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))

    async def scenario():
        clients = {wire: await client_on(wire, TargetClient, workers["target"]) for wire in ("unary", *STREAMED_WIRES)}
        try:
            for wire, client in clients.items():
                await prefill(client, f"voting-{wire}")
            first = await clients["unary"].verify("voting-unary", *empty, False, timeout=30, vote=alone)
            assert first.agreed_budget == 3
            held = await clients["stream"].verify("voting-stream", *empty, False, timeout=30, vote=crowd)
            assert held.agreed_budget == 3  # a change back from the first choice waits for the hold's passes
            ticked = [v.agreed_budget async for v in clients["socket"].decode("voting-socket", 12, lambda: 30)]
            assert ticked == [3] * 12
            again = await clients["socket"].verify("voting-socket", *empty, False, timeout=30, vote=crowd)
            assert again.agreed_budget == 7
            bad = [
                BudgetVote("gateway-c", budgets, np.array([1.0, float("nan"), 2.0, 3.0]), 1),
                BudgetVote("gateway-c", budgets, np.array([1.0, 2.0, 3.0, 4.0]), 1, np.array([True])),
            ]
            last = {"unary": first, "stream": held, "socket": again}
            for wire, client in clients.items():
                for vote in bad:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await client.verify(f"voting-{wire}", *empty, False, timeout=30, vote=vote)
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "budget_vote" in refused.value.details()
                after = await client.verify(f"voting-{wire}", *empty, False, timeout=30)  # the sequence goes on
                assert after.agreed_budget == 7 and after.committed_length == last[wire].committed_length + 1
            for wire, client in clients.items():
                await client.release(f"voting-{wire}")
        finally:
            for client in clients.values():
                await client.close()

    run(scenario())


def test_a_budget_vote_keeps_its_guessed_marks_on_the_wire():
    """``BudgetVote.guessed`` crosses the wire as it was; a vote without marks (an older gateway's)
    arrives as one that guessed nothing."""
    marked = BudgetVote("g", np.array([0, 3, 7]), np.array([1.0, 2.0, 3.0]), 4.0, np.array([False, False, True]))
    back = budget_vote_from_pb(target_pb2.BudgetVote.FromString(budget_vote_pb(marked).SerializeToString()))
    assert back.guessed.tolist() == [False, False, True] and back.budgets.tolist() == [0, 3, 7] and back.sequences == 4.0
    plain = BudgetVote("g", np.array([0, 3]), np.array([1.0, 2.0]), 1.0)
    assert budget_vote_from_pb(budget_vote_pb(plain)).guessed is None
