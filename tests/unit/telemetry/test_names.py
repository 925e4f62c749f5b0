"""Names are defined once, and the gen_ai.* ones are the OpenTelemetry GenAI conventions'."""

from __future__ import annotations

import pathlib
import re

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as semconv_attrs
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics as semconv_metrics

from kvfleet.telemetry import names

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_gen_ai_names_match_the_semantic_conventions():
    known = {v for k, v in vars(semconv_attrs).items() if k.startswith("GEN_AI_")}
    known |= {v for k, v in vars(semconv_metrics).items() if k.startswith("GEN_AI_")}
    ours = {v for k, v in vars(names).items() if isinstance(v, str) and v.startswith("gen_ai.")}
    assert ours and ours <= known, sorted(ours - known)


def test_span_names_follow_design():
    assert [names.ROUTER_GENERATE, names.ROUTER_TOKENIZE, names.ROUTER_ROUTE, names.ROUTER_DISPATCH,
            names.WORKER_GENERATE, names.WORKER_QUEUE, names.WORKER_PREFILL, names.WORKER_DECODE] == [
        "router.Generate", "router.tokenize", "router.route", "router.dispatch",
        "worker.Generate", "worker.queue", "worker.prefill", "worker.decode"]


def test_no_name_is_spelled_outside_the_names_module():
    """Every span/attribute/metric string lives in kvfleet/telemetry/names.py (STYLE 9)."""
    values = {v for k, v in vars(names).items()
              if k.isupper() and isinstance(v, str) and re.fullmatch(r"[a-z_]+\.[a-zA-Z_.]+", v)}
    sources = [p for d in ("kvfleet", "router", "worker", "deploy", "bench")
               for p in (ROOT / d).rglob("*.py") if p.name != "names.py" and "/v1/" not in str(p)]
    offenders = []
    for path in sources:
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {v}" for v in values
                      if f'"{v}"' in text or f"'{v}'" in text]
    assert not offenders, offenders
