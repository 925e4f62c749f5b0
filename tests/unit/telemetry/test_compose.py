"""deploy/compose: the Collector + Jaeger stack parses and is wired consistently (Docker is not
available where the suite runs, so this is the check it gets)."""

from __future__ import annotations

import pathlib

import yaml

COMPOSE = pathlib.Path(__file__).resolve().parents[3] / "deploy" / "compose"


def load(name: str) -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())


def test_compose_services_images_and_ports():
    services = load("docker-compose.yaml")["services"]
    assert {"otel-collector", "jaeger"} <= services.keys()
    for svc in services.values():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"pin {image}"
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{port}: publish on loopback only"
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert services["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    published = {p.split(":")[1] for p in services["otel-collector"]["ports"]}
    assert {"4317", "4318"} <= published
    assert "127.0.0.1:16686:16686" in services["jaeger"]["ports"]
    assert "jaeger" in services["otel-collector"]["depends_on"]
    mounts = [v.split(":")[0] for v in services["otel-collector"]["volumes"]]
    assert all((COMPOSE / m).is_file() for m in mounts)


def test_collector_pipelines_use_defined_components():
    cfg = load("otel-collector.yaml")
    pipelines = cfg["service"]["pipelines"]
    assert {"traces", "metrics"} <= pipelines.keys()
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            for name in pipeline.get(kind, []):
                assert name in cfg[kind], f"{name} is not defined under {kind}"
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    assert cfg["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"  # the compose service
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg["extensions"]
