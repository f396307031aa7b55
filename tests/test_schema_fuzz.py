"""schemathesis over the app's whole OpenAPI schema, with every check it has, against the API served
on a real Redis: not one request it makes gets a server error, and every answer is what the
document says (its status, content type and error shape), with one exception per entry of the
README's list "What schemathesis still reports, and why" (section "HTTP API"): ALLOWED below.

Its run is bounded (a fixed seed, a few dozen examples per operation, no stateful phase) to stay
under a minute or two on two cores. The one live stream (GET /v1/dashboard/stream, open for about
25 s by design) is left out: every request to it would wait out its own time.
"""

from __future__ import annotations

import asyncio
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Final, NamedTuple

import redis.asyncio as aioredis

from tests.test_api_support import fleet_and_api

SEED = 20261203
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
# A request with more messages or inputs than the limits is refused with 413 (which the document
# says: maxItems), a status schemathesis does not expect of a refusal by default.
CONFIG: Final = """
[checks.negative_data_rejection]
expected-statuses = [
    "400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx",
]
"""


class Allowed(NamedTuple):
    """A report schemathesis still makes: its check's code and what the answer's body says."""

    code: str
    answer: str
    why: str


# The README's list, entry by entry: requests the schema allows and the API refuses with a 400 for a
# reason no schema can state, and the one 5xx that is a model's failure rather than the API's.
ALLOWED: Final = (
    Allowed(
        "ST202",
        r"does not support|cannot embed|no model the live fleet serves (supports|answers)",
        "a capability (tools, images, thinking, embedding) the serving model lacks: the fleet's to say",
    ),
    Allowed("ST202", r"tool_choice", "a tool_choice without tools, or naming a tool not offered"),
    Allowed("ST202", r"two tools are named", "two tools of one name"),
    Allowed(
        "ST202", r"cannot be sent to a backend", "an integer beyond 64 bits inside options, format or tools"
    ),
    Allowed("ST202", r"could not be decoded to text", "token arrays where cl100k_base cannot be loaded"),
    Allowed("ST202", r"could not (pull|delete) .* on ", "a pull or delete the machines' own servers refuse"),
    Allowed("ST202", r"option 'num_ctx' above", "num_ctx written with a fraction (4096.0)"),
    Allowed("ST101", r'"generation_failed".*decomposer', "a decomposer model that answered no usable plan"),
)


class Reported(NamedTuple):
    operation: str
    code: str
    status: str
    answer: str


def reported(junit: Path) -> list[Reported]:
    """Every failure in schemathesis's JUnit report: the operation, the check's code, the status
    and body of the answer."""
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for failure in case.iter("failure"):
            # One report per failing test case, each with its checks, then the answer.
            for block in re.split(r"^\d+\. Test Case ID: ", failure.text or "", flags=re.M)[1:]:
                answer = re.search(r"^\[(\d+)\][^\n]*\n\s*`(.*?)`\s*$", block, flags=re.M | re.S)
                status, body = (answer.group(1), answer.group(2)) if answer else ("", "")
                for code in re.findall(r"^- (ST\d+) ", block, flags=re.M):
                    found.append(Reported(case.get("name", ""), code, status, body))
    return found


def unexplained(found: list[Reported]) -> list[Reported]:
    return [r for r in found if not any(a.code == r.code and re.search(a.answer, r.answer) for a in ALLOWED)]


async def test_schemathesis_with_every_check_finds_no_server_error_and_nothing_unlisted(
    redis_client: aioredis.Redis, redis_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    # Simulated machines that answer at once: requests naming a served model are routed, queued
    # and run, deeper than a 404, and a waiting request gets its answer rather than a 504.
    async with fleet_and_api(
        redis_client,
        redis_url,
        workers=("a", "b", "c"),
        time_scale=0.0,
        slots=4,
        max_body_bytes=64 * 1024,
        max_messages=64,
    ) as (base, _):
        proc = await asyncio.create_subprocess_exec(
            str(SCHEMATHESIS),
            "--config-file",
            str(config),
            "run",
            f"{base}/openapi.json",
            "--checks",
            "all",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            "25",
            "--seed",
            str(SEED),
            "--workers",
            "1",
            "--request-timeout",
            "20",
            "--continue-on-failure",
            "--generation-database",
            "none",
            "--exclude-path",
            "/v1/dashboard/stream",
            "--report",
            "junit",
            "--report-junit-path",
            str(tmp_path / "junit.xml"),
            "--no-color",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=tmp_path,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
    text = out.decode(errors="replace")
    found = reported(tmp_path / "junit.xml")
    # Every check the summary counts failures of was read from the report.
    assert {r.code for r in found} == set(re.findall(r"(ST\d+) [^\n:]*: \d+", text)), text[-4000:]
    assert not unexplained(found), "\n".join(map(str, unexplained(found))) + "\n" + text[-4000:]
    # No server error of the API's own (a 502 is a model's, listed above), whatever check saw it.
    assert not [r for r in found if r.status.startswith("5") and r.status != "502"], text[-4000:]
    # It did test: every operation but the one left out, with thousands of generated requests.
    tested = re.search(r"Tested: (\d+)", text)
    generated = re.search(r"(\d+) generated", text)
    assert tested is not None and int(tested.group(1)) >= 30, text[-3000:]
    assert generated is not None and int(generated.group(1)) >= 2000, text[-3000:]


def test_a_report_is_read_case_by_case_and_only_the_listed_reasons_pass(tmp_path: Path) -> None:
    # The shape of schemathesis's JUnit report: one failure per operation, its cases numbered.
    junit = tmp_path / "junit.xml"
    junit.write_text(
        """<testsuites><testsuite name="schemathesis">
<testcase name="POST /v1/chat/completions"><failure type="failure" message="ST202">1. Test Case ID: a1

- ST202 Schema-valid request rejected

[400] Bad Request:

    `{"error":{"message":"tool_choice is only allowed when tools are offered"}}`

Reproduce with: curl

2. Test Case ID: b2

- ST202 Schema-valid request rejected

- ST103 Undocumented status code

[422] Unprocessable Content:

    `{"error":{"message":"body.max_tokens: Input should be a valid integer"}}`

Reproduce with: curl</failure></testcase>
<testcase name="GET /v1/fleet"/>
</testsuite></testsuites>"""
    )
    found = reported(junit)
    assert [(r.operation, r.code, r.status) for r in found] == [
        ("POST /v1/chat/completions", "ST202", "400"),
        ("POST /v1/chat/completions", "ST202", "422"),
        ("POST /v1/chat/completions", "ST103", "422"),
    ]
    assert [(r.code, r.status) for r in unexplained(found)] == [("ST202", "422"), ("ST103", "422")]
