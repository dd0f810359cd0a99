"""What a client sees of the router's admission: the fleet's overload stage the request was
decided in, and the output cap a stage put on it (S2 and up), as headers and as a field of the
final chunk (streamed) or the body (not streamed)."""
from __future__ import annotations

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

STAGE_HEADER = "x-kvfleet-stage"
OUTPUT_CAP_HEADER = "x-kvfleet-output-cap"


def admission_headers(plan: pb.Plan | None) -> dict[str, str]:
    if plan is None:
        return {}
    headers = {STAGE_HEADER: pb.OverloadStage.Name(plan.stage)}
    if plan.output_cap:
        headers[OUTPUT_CAP_HEADER] = str(plan.output_cap)
    return headers


def admission_fields(plan: pb.Plan | None) -> dict:
    """{"admission": {"stage": name, "output_cap": n (only when the stage capped it)}}."""
    if plan is None:
        return {}
    fields = {"stage": pb.OverloadStage.Name(plan.stage)}
    if plan.output_cap:
        fields["output_cap"] = plan.output_cap
    return {"admission": fields}
