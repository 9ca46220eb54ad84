"""Attribution below the tenant: the API key's id from the key map and the end user the request names,
on the span and never as a metric label."""

import hashlib
import json

import pytest

from otel_llm import semconv
from otel_llm.config import Settings
from otel_llm.vllm.attribution import KEY_ID_LENGTH, Attribution, Caller, load_api_keys
from otel_llm.vllm.request_telemetry import RequestInfo, start_request
from otel_llm.vllm.sink import InProcessSink
from otel_llm.vllm.telemetry import Telemetry

KEY_A, KEY_B, KEY_C = "sk-a-" + "1" * 24, "sk-b-" + "2" * 24, "sk-c-" + "3" * 24


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps(
            {
                "keys": [
                    {"sha256": sha(KEY_A), "tenant": "acme", "scene": "support", "id": "acme-prod"},
                    {"sha256": sha(KEY_B), "tenant": "acme", "cost_center": "cc-1"},  # no id: a prefix of its hash
                ]
            }
        )
    )
    return path


def test_a_mapped_key_names_its_tenant_and_its_id_an_unmapped_one_neither(keys_file):
    attribution = Attribution(Settings(api_keys_file=str(keys_file)))
    assert attribution.caller({"authorization": f"Bearer {KEY_A}"}) == Caller("acme", "support", None, "acme-prod")
    assert attribution.caller({"authorization": f"bearer {KEY_B}"}) == Caller(
        "acme", None, "cc-1", sha(KEY_B)[:KEY_ID_LENGTH]
    )
    # the three-field call (the engine's baggage, other callers) is unchanged
    assert attribution({"authorization": f"Bearer {KEY_A}"}) == ("acme", "support", None)
    # an unknown key: tenant from the headers, no key id (no id is made up from a key the map lacks)
    assert attribution.caller({"authorization": f"Bearer {KEY_C}", "x-tenant-id": "beta"}) == Caller(
        "beta", None, None, None
    )
    # the key map vouches for tenants and scenes, not ids
    assert attribution.vouched() == [frozenset({"acme"}), frozenset({"support"}), frozenset({"cc-1"})]


def test_an_id_that_is_the_key_itself_makes_the_map_unusable(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"sha256": sha(KEY_A), "tenant": "acme", "id": KEY_A}]}))
    with pytest.raises(ValueError, match="is the key itself"):
        load_api_keys(str(path))
    assert Attribution(Settings(api_keys_file=str(path))).api_keys == {}  # warned; tenants from headers
    path.write_text(json.dumps({"keys": [{"sha256": sha(KEY_A), "tenant": "acme", "id": "a\nb"}]}))
    with pytest.raises(ValueError, match="not a printable string"):
        load_api_keys(str(path))


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"user": "u-1"}, "u-1"),
        ({"safety_identifier": "hash-9", "user": "u-1"}, "hash-9"),  # the newer field wins
        ({"user": "  u-2 "}, "u-2"),
        ({"user": "x" * 129}, None),  # over OTEL_LLM_ATTRIBUTION_MAX_LENGTH: refused whole, never cut
        ({"user": "a\x1bb"}, None),
        ({"user": 42}, None),
        ({}, None),
    ],
)
def test_the_end_user_is_checked_like_a_tenant_value(fields, expected):
    assert Attribution(Settings()).end_user(fields.get) == expected


def test_key_id_and_user_are_on_the_span_and_never_metric_labels(memory_otel, keys_file):
    tel = Telemetry(
        InProcessSink(memory_otel.tracer_provider.get_tracer("t"), memory_otel.meter_provider.get_meter("t")),
        memory_otel.meter_provider.get_meter("t"),
        Settings(api_keys_file=str(keys_file)),
    )
    caller = tel.attribution.caller({"authorization": f"Bearer {KEY_A}"})
    info = RequestInfo(
        operation=semconv.OP_CHAT, model="m", tenant=caller.tenant, api_key_id=caller.api_key_id, user="end-user-7"
    )
    start_request(tel, info).end()
    (span,) = memory_otel.spans.get_finished_spans()
    assert (span.attributes[semconv.API_KEY_ID], span.attributes[semconv.USER_ID]) == ("acme-prod", "end-user-7")
    data = memory_otel.reader.get_metrics_data()
    labels = {
        key
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for point in m.data.data_points
        for key in point.attributes
    }
    assert semconv.TENANT_ID in labels  # the points are there, with the tenant
    assert not labels & {semconv.API_KEY_ID, semconv.USER_ID}


def test_one_caller_per_request_from_its_headers_and_fields(keys_file):
    attribution = Attribution(Settings(api_keys_file=str(keys_file)))
    headers = {"authorization": f"Bearer {KEY_A}"}
    fields = {"user": "end-user-7"}.get
    assert attribution.request_caller(headers, fields) == Caller("acme", "support", None, "acme-prod", "end-user-7")
    assert attribution.request_caller(headers) == Caller("acme", "support", None, "acme-prod")  # no fields: no user


def test_a_lenient_caller_leaves_out_what_fails(monkeypatch):
    from otel_llm import warn

    attribution = Attribution(Settings())

    def boom(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(attribution, "caller", boom)
    with pytest.raises(RuntimeError):
        attribution.request_caller({}, {}.get)  # a handler's: its guard loses the span
    before = warn.failures().get("reading a request's tenant", 0)
    assert attribution.request_caller({}, {"user": "u"}.get, lenient=True) == Caller(None, None, None, None, "u")
    assert warn.failures()["reading a request's tenant"] == before + 1
    monkeypatch.setattr(attribution, "end_user", boom)
    monkeypatch.setattr(attribution, "caller", lambda headers: Caller("t", None, None, None))
    assert attribution.request_caller({}, {}.get, lenient=True) == Caller("t", None, None, None)


def test_starlette_headers_give_the_answers_of_a_plain_mapping():
    """Starlette's Headers (a handler's raw_request.headers) answer as a plain mapping of the same
    values: first occurrence, case-insensitive names, an empty value skipped for the next name,
    latin-1 values."""
    from starlette.datastructures import Headers

    settings = Settings(
        tenant_headers=("x-tenant-id", "x-org"), scene_headers=("x-scene",), cost_center_headers=("x-cc",)
    )
    attribution = Attribution(settings)
    cases = [
        [(b"x-tenant-id", b"acme"), (b"x-tenant-id", b"other"), (b"x-scene", b"chat")],
        [(b"x-tenant-id", b""), (b"x-org", b"beta"), (b"x-cc", "caf\xe9".encode("latin-1"))],
        [(b"x-org", b"gamma"), (b"x-tenant-id", b"delta")],
        [(b"content-type", b"application/json")],
        [(b"X-Scene", b"upper"), (b"x-scene", b"lower")],  # (ASGI names are lowercase: Starlette matches them so)
        [],
    ]
    for raw in cases:
        headers = Headers(raw=raw)
        by_get = {name: headers.get(name) for name in ("x-tenant-id", "x-org", "x-scene", "x-cc")}
        assert attribution.caller(headers) == attribution.caller(by_get), raw
    assert attribution.caller(Headers(raw=cases[1])) == Caller("beta", None, "caf\xe9", None)
    assert attribution.caller(Headers(raw=cases[2])) == Caller("delta", None, None, None)
    assert attribution.caller(Headers(raw=cases[4])) == Caller(None, "lower", None, None)


def test_the_engine_gets_the_callers_baggage_escaped_and_kept_for_the_next_request():
    """Attribution.baggage: the header the engine's record of a request takes its tenant, scene and cost
    center from (under the first baggage key of each), values percent-escaped; None without any. One
    string per caller, kept for the next request (BAGGAGE_CACHE callers at most)."""
    from opentelemetry import baggage
    from opentelemetry.baggage.propagation import W3CBaggagePropagator

    from otel_llm.vllm.attribution import BAGGAGE_CACHE

    attribution = Attribution(Settings(scene_baggage_keys=("team", semconv.TENANT_SCENE), cost_center_baggage_keys=()))
    header = attribution.baggage("acme, inc=1;x", "chat/ui", "cc-1")
    assert header == f"{semconv.TENANT_ID}=acme%2C%20inc%3D1%3Bx,team=chat%2Fui"
    read = baggage.get_all(W3CBaggagePropagator().extract({"baggage": header}))
    assert dict(read) == {semconv.TENANT_ID: "acme, inc=1;x", "team": "chat/ui"}
    assert attribution.baggage(None, None, "cc-1") is None
    assert attribution.baggage("acme, inc=1;x", "chat/ui", "cc-1") is header
    for i in range(2 * BAGGAGE_CACHE):
        attribution.baggage(f"t{i}", None, None)
    assert attribution.baggage.cache_info().currsize == BAGGAGE_CACHE


def test_a_header_value_is_checked_once_and_answers_the_same_every_time():
    """Header values (tenant, scene, cost center) are kept with their checked value: a second request with
    the same values gets the same caller, invalid values refused again, with no second warning, and at
    most CHECKED_CACHE values kept."""
    from otel_llm.vllm import attribution as module

    attribution = Attribution(Settings(attribution_max_length=8))
    raw = [(b"x-tenant-id", b" acme "), (b"x-scene", b"far-too-long"), (b"x-cost-center", b"c\x01")]
    first = attribution.caller(list(raw))
    assert first == Caller("acme", None, None, None)
    assert attribution.caller(list(raw)) == first
    assert attribution._checked == {" acme ": "acme", "far-too-long": None, "c\x01": None}
    for i in range(module.CHECKED_CACHE + 10):
        assert attribution.caller([(b"x-tenant-id", b"t%d" % i)]).tenant == f"t{i}"
    assert len(attribution._checked) == module.CHECKED_CACHE
    assert attribution.caller([(b"x-tenant-id", b"late-one")]).tenant == "late-one"  # (checked, not kept)
