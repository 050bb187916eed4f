"""Every route fuzzed from the server's own OpenAPI description (Schemathesis): documented data and
data that breaks the description, all answered without a 5xx, with a documented status, content type
and body shape. Deterministic (derandomized Hypothesis) and bounded (a few hundred requests)."""

from __future__ import annotations

import re

from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)
from server_fixtures import ServerThread, make_engine, tiny_model_dir

from specloop.server.app import build_app
from specloop.server.openapi import openapi

AUTH = {"Authorization": "Bearer sekret"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
EXAMPLES_PER_ROUTE = 40

schema = schemathesis.openapi.from_dict(openapi(api_key=True, models=["tiny"]))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    engine = make_engine(tiny_model_dir(), max_model_len=128)
    with ServerThread(build_app(engine, served_model_name="tiny", api_key="sekret")) as srv:
        yield srv


def test_the_description_is_served(server: ServerThread) -> None:
    served = httpx.get(server.url + "/openapi.json").json()
    assert served == openapi(api_key=True, models=["tiny"])
    # Starlette's path converters ("{model:path}") are the same parameters in OpenAPI's notation.
    assert set(served["paths"]) == {re.sub(r"{(\w+):\w+}", r"{\1}", route.path) for route in server.app.routes}


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_route_against_its_description(case: Any, server: ServerThread) -> None:
    if isinstance(case.body, dict) and case.operation.path.startswith("/v1/"):
        # Short generations keep the run bounded; every other field is the fuzzer's.
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int):
                case.body[field] = min(max(case.body[field], -2), 8)
        # A rule the description cannot state, which would refuse most generated bodies otherwise.
        if case.body.get("stream") is not True:
            case.body.pop("stream_options", None)
    case.call_and_validate(base_url=server.url, headers=AUTH, checks=CHECKS, timeout=60)

