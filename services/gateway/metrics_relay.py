"""One scrape target: core's and every worker's Prometheus series, relayed through the gateway's
`/metrics` with a `service` label ("core" or "expert") and, for workers, a `worker` label (its
address). Core gathers them (`Core.GetMetrics`); series of one name from several services become
one family, told apart by those labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from services.proto.moemesh.v1 import core_pb2

RELAY_UP = "moe_mesh_service_scrape_up"  # 1 per service whose series arrived, 0 per one that did not


class _Relayed:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def relabel(response: core_pb2.GetMetricsResponse) -> list[Metric]:
    """Every service's families, merged by name, each sample labelled with its service."""
    merged: dict[str, Metric] = {}
    up = Metric(RELAY_UP, "Whether the gateway could read this service's metrics through core", "gauge")
    for service in response.services:
        labels = {"service": service.service, **({"worker": service.worker} if service.worker else {})}
        up.samples.append(Sample(RELAY_UP, labels, 0.0 if service.error else 1.0))
        if service.error:
            continue
        for family in text_string_to_metric_families(service.text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # creation times: no dashboard plots them, and they double the lines
                target.samples.append(sample._replace(labels={**sample.labels, **labels}))
    return [up, *merged.values()]


def relayed_exposition(response: core_pb2.GetMetricsResponse) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Relayed(relabel(response)))
    return generate_latest(registry)
