"""Clients that try to stall everyone else: huge bodies, huge conversations, long stop strings,
sockets that never finish a request, numbers past 64 bits, and the API key's scheme in any case.

Each large request is sent while a watcher on the server's event loop records its longest stall
(``LoopLag``); before the work was moved off the loop these stalls were seconds long."""

from __future__ import annotations

import socket
from typing import Any, Iterator

import httpx
import orjson
import pytest
from server_fixtures import MAX_MODEL_LEN, ServerThread, make_engine, tiny_model_dir

from specloop.server.app import ServerLimits, build_app
from specloop.server.connections import ConnectionLimits

MODEL = "tiny"
C, CHAT = "/v1/completions", "/v1/chat/completions"
AUTH = {"Authorization": "Bearer sekret"}
# What the event loop may stall for under one hostile request on a busy 2-core machine (the whole
# suite in one process: a garbage collection may land in it). The stalls
# these tests were written against were 1.7 to 19 seconds; a watcher tick is 1 ms.
STALL = 1.0


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def server(request: Any) -> Iterator[ServerThread]:
    connections = ConnectionLimits(header_timeout=0.5, body_timeout=0.5, max_connections=24)
    engine = make_engine(tiny_model_dir(), engine_process=request.param == "engine-process")
    app = build_app(engine, served_model_name=MODEL, api_key="sekret")
    with ServerThread(app, connections) as srv:
        yield srv


def post(server: ServerThread, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[httpx.Response, float]:
    """POST a (large) body while watching the server's loop: the response and the worst stall."""
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    with server.lag() as lag:
        r = httpx.post(server.url + path, content=content, timeout=120,
                       headers={"content-type": "application/json", **(headers if headers is not None else AUTH)})
    print(f"{path} {len(content) / 1e6:.1f} MB -> {r.status_code} in {r.elapsed.total_seconds():.3f} s, "
          f"worst loop stall {lag.worst * 1000:.1f} ms")
    return r, lag.worst


def error_of(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param, error
    return error


# --- work in proportion to a request stays off the event loop ------------------------------------

def test_a_huge_prompt_is_refused_before_tokenizing(server: ServerThread) -> None:
    """A 14 MB prompt was tokenized on the event loop (19 s during which /health hung)."""
    r, stall = post(server, C, {"prompt": "x = 1\n" * 2_300_000, "max_tokens": 1})
    assert "characters" in error_of(r, 400, "prompt")["message"] and r.json()["error"]["code"] == "context_length_exceeded"
    assert stall < STALL


def test_huge_conversations_are_refused_before_rendering(server: ServerThread) -> None:
    """400,000 one-word messages were parsed and rendered on the event loop (7.8 s)."""
    messages = [{"role": "user", "content": "hi"}]
    r, stall = post(server, CHAT, {"messages": messages * 400_000})
    assert error_of(r, 413, None)["code"] == "request_too_large"
    assert stall < STALL
    r, stall = post(server, CHAT, {"messages": messages * 5000})
    assert "4096" in error_of(r, 400, "messages")["message"]
    r, stall = post(server, CHAT, {"messages": [{"role": "user", "content": "a " * 3_000_000}]})
    assert error_of(r, 400, "messages")["code"] == "context_length_exceeded"
    assert stall < STALL


def test_tokenize_and_detokenize_take_the_key_and_are_capped(server: ServerThread) -> None:
    """/tokenize needed no key and tokenized 14 MB on the loop (13.5 s); a 15 MB /detokenize built a
    160 MB response (1.7 s)."""
    assert error_of(httpx.post(server.url + "/tokenize", json={"prompt": "hi"}), 401, None)
    assert error_of(httpx.post(server.url + "/detokenize", json={"tokens": [5]}), 401, None)
    r, stall = post(server, "/tokenize", {"prompt": "x = 1\n" * 2_300_000})
    assert error_of(r, 400, "prompt")["code"] == "context_length_exceeded"
    assert stall < STALL
    r, stall = post(server, "/detokenize", {"tokens": [5] * 7_000_000})
    assert error_of(r, 413, None)["code"] == "request_too_large"
    assert stall < STALL
    r, _ = post(server, "/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)})
    assert error_of(r, 400, "tokens")["code"] == "context_length_exceeded"
    # Up to the whole context is fine (as vLLM: nothing is generated).
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "hello world " * 10}, headers=AUTH).json()["tokens"]
    assert len(ids) <= MAX_MODEL_LEN
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=AUTH).status_code == 200


def test_a_prompt_that_fits_is_still_served(server: ServerThread) -> None:
    r, stall = post(server, C, {"prompt": [7] * (MAX_MODEL_LEN - 2), "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 2
    assert stall < STALL


def test_stop_strings_have_a_length_limit(server: ServerThread) -> None:
    """64 stop strings of 20,000 characters were matched at every token, at a cost that grew with
    their length, on the event loop (189 s instead of 8 for n=16)."""
    body = {"prompt": "Hello", "max_tokens": 4, "n": 16, "ignore_eos": True}
    r, stall = post(server, C, {**body, "stop": [f"{i:02d}" + "ab" * 10_000 for i in range(64)]})
    assert "1024" in error_of(r, 400, "stop")["message"]
    assert stall < STALL
    r, stall = post(server, C, {**body, "stop": [f"{i:02d}" + "ab" * 511 for i in range(64)]})
    assert r.status_code == 200 and len(r.json()["choices"]) == 16
    assert stall < STALL


# --- numbers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("seed", 2**63), ("seed", 2**64 - 1), ("seed", -2**63 - 1),
                                         ("max_tokens", 2**64 + 1), ("n", 10**30), ("top_k", 2**70)])
def test_integers_past_64_bits_are_reported_as_integers(server: ServerThread, field: str, value: int) -> None:
    """Integers past 2**64 were parsed as floats ("got 1.8446744073709552e+19"); seeds in
    [2**63, 2**64) were taken and silently became negative."""
    r = httpx.post(server.url + C, content=b'{"prompt": "hi", "%s": %d}' % (field.encode(), value), headers=AUTH)
    error = error_of(r, 400, field)
    assert str(value) in error["message"] and "e+" not in error["message"], error


def test_the_authorization_scheme_is_case_insensitive(server: ServerThread) -> None:
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} sekret"})
        assert r.status_code == 200, scheme
    for header in ("Bearer nope", "Basic sekret", "Bearersekret", "sekret"):
        error_of(httpx.get(server.url + "/v1/models", headers={"Authorization": header}), 401, None)


# --- connections --------------------------------------------------------------------------------

def stalled(server: ServerThread, first_bytes: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's 10 s timeout fails
    the test if it never does)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n"


@pytest.mark.parametrize("first_bytes", [b"", HEAD[:30], HEAD], ids=["nothing", "partial-head", "head-only"])
def test_a_connection_that_never_sends_its_head_is_closed(server: ServerThread, first_bytes: bytes) -> None:
    """A socket that sent nothing or part of a request head stayed open for good."""
    assert read_until_closed(stalled(server, first_bytes)) == b""


def test_a_body_that_stalls_gets_408_and_the_connection_closes(server: ServerThread) -> None:
    reply = read_until_closed(stalled(server, HEAD + b"authorization: Bearer sekret\r\n\r\n" + b'{"prompt": '))
    assert reply.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in reply


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_stalled_sockets_cannot_crowd_out_requests() -> None:
    """600 stalled sockets under `ulimit -n 512` once made normal requests fail ("Connection reset by
    peer"). Past the cap the oldest connections still waiting for a head are closed (long before
    their deadline here), so a new request always gets in and the server never holds more than
    the cap."""
    cap = 16
    connections = ConnectionLimits(header_timeout=60, body_timeout=60, max_connections=cap)
    with ServerThread(build_app(make_engine(tiny_model_dir()), served_model_name=MODEL), connections) as srv:
        socks = [stalled(srv, HEAD[:20]) for _ in range(3 * cap)]
        try:
            for _ in range(3):
                r = httpx.post(srv.url + C, json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
                assert r.status_code == 200
                assert len(srv.server.server_state.connections) <= cap
            assert all(closed_by_server(sock) for sock in socks[:2 * cap])  # the oldest made room
        finally:
            for sock in socks:
                sock.close()


def test_keep_alive_connections_serve_request_after_request(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH) as client:
        for _ in range(3):
            assert client.post(C, json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
            assert client.get("/health").status_code == 200
