"""The epp extra's Envoy API (xds-protos) and the sidecar's OTLP exporter (opentelemetry-proto)
install modules under the same ``opentelemetry.proto`` package: xds-protos carries an old
copy, and whichever pip installs second wins. The exporter needs opentelemetry-proto's own
(``InstrumentationScope``); the Makefile puts them back after installing the dev extra,
which has both."""

from __future__ import annotations


def test_the_otlp_exporter_and_envoys_api_import_side_by_side() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope

    assert external_processor_pb2.DESCRIPTOR.package == "envoy.service.ext_proc.v3"
    assert InstrumentationScope.DESCRIPTOR.name == "InstrumentationScope"
    assert OTLPSpanExporter is not None
