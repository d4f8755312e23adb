"""``splitspec generate``: a gRPC client that streams a completion to stdout and reports usage."""

from __future__ import annotations

import argparse
import sys
import time

from splitspec.transport.security import add_client_arguments, client_security

MODES = {"ddtree": 1, "chain": 2, "off": 3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (with --chat: the user message)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message, rendered by the model's chat template")
    p.add_argument("--system", default="", help="with --chat: a system message before the user message")
    p.add_argument("--address", default="127.0.0.1:50051", help="gateway address")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same output, whatever the speculation")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--mode", choices=list(MODES), default=None, help="speculation mode (default: the server's)")
    p.add_argument("--budget", type=int, default=0, help="tree nodes per step (default: the server's)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline for the whole request, seconds (with --wait, the wait for the gateway included)")
    p.add_argument(
        "--connect-timeout", type=float, default=10.0,
        help="seconds to wait for a gateway to accept the connection before giving up (see --wait)",
    )
    p.add_argument(
        "--wait", action="store_true",
        help="wait for the gateway up to --timeout instead of --connect-timeout (for a `splitspec serve` still loading its models)",
    )
    add_client_arguments(p, "", "gateway")


def connect(channel, address: str, limit: float, waiting: bool = False) -> bool:
    """Wait up to ``limit`` seconds for ``channel`` to connect; say so at once on stderr when it does not
    right away. False (after one line saying what to do) when no gateway answered in time."""
    import grpc

    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=min(0.25, limit))
        return True
    except grpc.FutureTimeoutError:
        pass
    print(
        f"splitspec generate: waiting for the gateway at {address} (up to {limit:.0f} s; start one with `splitspec serve`)",
        file=sys.stderr, flush=True,
    )
    try:
        ready.result(timeout=max(0.0, limit - 0.25))
        return True
    except grpc.FutureTimeoutError:
        ready.cancel()
        print(
            f"splitspec generate: no gateway answered at {address} within {limit:.0f} s: start one with `splitspec serve`, "
            + ("check --address, or raise --timeout" if waiting else "check --address, or pass --wait to wait longer"),
            file=sys.stderr, flush=True,
        )
        return False


def run(args: argparse.Namespace) -> int:
    import grpc

    from splitspec.transport.rpc import CHANNEL_OPTIONS
    from splitspec.v1 import gateway_pb2, gateway_pb2_grpc

    if args.chat:
        turns = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
        prompt = {"messages": gateway_pb2.Messages(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in turns])}
    elif args.system:
        print("splitspec generate: --system needs --chat", file=sys.stderr)
        return 2
    else:
        prompt = {"text": args.prompt}
    request = gateway_pb2.GenerateRequest(
        **prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
        speculation=gateway_pb2.Speculation(mode=MODES.get(args.mode, 0), budget=args.budget),
    )
    security = client_security(args, "")
    credentials = security.channel_credentials()
    options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", security.server_name)] if security.server_name else [])
    # While waiting, retry the connection at least every second (gRPC's back-off grows to minutes),
    # so that a gateway that comes up is used at once.
    options += [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
    t0 = time.perf_counter()
    first = None
    channel = grpc.secure_channel(args.address, credentials, options) if credentials else grpc.insecure_channel(args.address, options)
    with channel:
        if not connect(channel, args.address, args.timeout if args.wait else min(args.connect_timeout, args.timeout), args.wait):
            return 1
        stub = gateway_pb2_grpc.GatewayStub(channel)
        started = time.perf_counter()  # rates and first-text time count from here, not from the wait
        try:
            # wait_for_ready: a connection lost between the wait above and the call is waited for too.
            remaining = max(0.001, args.timeout - (time.perf_counter() - t0))
            responses = stub.Generate(request, timeout=remaining, wait_for_ready=True, metadata=security.metadata())
            for response in responses:
                if response.text:
                    first = first or time.perf_counter()
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                if response.HasField("final"):
                    final = response.final
        except grpc.RpcError as exc:
            print(f"\nsplitspec generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - started
    u = final.usage
    print(
        f"\n[{gateway_pb2.FinishReason.Name(final.finish_reason).lower()}: {u.prompt_tokens} prompt + "
        f"{u.completion_tokens} generated tokens in prefill + {u.steps} verify steps, mean acceptance length "
        f"{u.mean_acceptance_length:.2f}, {u.completion_tokens / elapsed:.1f} tok/s"
        + (f", {1000 * elapsed / u.steps:.1f} ms/step" if u.steps else "")
        + (f", first text after {first - started:.3f} s" if first else "")
        + (f", {u.draft_fallbacks} draft fallbacks" if u.draft_fallbacks else "")
        + "]",
        file=sys.stderr,
    )
    return 0
