"""Which tenant, scene and cost center a request belongs to: the API key's entry in
OTEL_LLM_API_KEYS_FILE (stored hashed), else request headers, else W3C baggage; the key's id from that
entry and the end user the request names, below the tenant; and the label guards that keep tenant
values low-cardinality on metrics (spans and usage records keep the full value).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from functools import lru_cache, partial
from itertools import repeat
from typing import NamedTuple
from urllib.parse import quote

from otel_llm import semconv
from otel_llm.config import ENV_API_KEYS_FILE, ENV_ATTRIBUTION_MAX_LENGTH, Settings
from otel_llm.sdk import current
from otel_llm.warn import WarnOnce, failed, warn_once


class ApiKey(NamedTuple):
    """An API key's entry in the key map."""

    tenant: str
    scene: str | None
    cost_center: str | None
    id: str  # the key's name in telemetry: the entry's "id", else the first KEY_ID_LENGTH hex of its sha256


# a default key id: enough of the hash to find the entry in the key map, never enough to matter (the
# hash of a random key reveals nothing; what is exported is a prefix of it)
KEY_ID_LENGTH = 12


class Caller(NamedTuple):
    """Who a request is billed to: its tenant, scene, cost center, the id of its API key, and the end
    user it names (below the tenant)."""

    tenant: str | None
    scene: str | None
    cost_center: str | None
    api_key_id: str | None
    user: str | None = None


NO_CALLER = Caller(None, None, None, None)
# Caller(*values) without the named tuple's Python __new__ (a frame per request): tuple.__new__ in C
_new_caller = partial(tuple.__new__, Caller)


# callers whose baggage header Attribution.baggage keeps
BAGGAGE_CACHE = 256
# tenant, scene and cost-center values as sent, with their checked value, Attribution keeps (the same
# few come again and again; at most attribution_max_length characters each where valid)
CHECKED_CACHE = 1024
_UNCHECKED = object()


class Attribution:
    """(tenant, scene, cost center) of a request, each None when unknown; `caller` adds its API key's id."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.api_keys = _load_api_keys(settings.api_keys_file)
        self._warn = WarnOnce()  # per instance: each Telemetry warns about its own requests
        # the baggage header per caller: the same few tenants ask again and again (bounded: values are
        # at most attribution_max_length long)
        self.baggage = lru_cache(maxsize=BAGGAGE_CACHE)(self._baggage)
        self._checked: dict[str, str | None] = {}  # a header's value -> its checked value (`_valid`)
        # the tenant, scene and cost-center header names as an ASGI scope's header names come (lowercase
        # bytes), for a _FirstValues' own dict; None where one is not latin-1 (then its `get` answers)
        try:
            self._header_keys = tuple(
                tuple(name.lower().encode("latin-1") for name in names)
                for names in (settings.tenant_headers, settings.scene_headers, settings.cost_center_headers)
            )
        except UnicodeEncodeError:
            self._header_keys = None

    def _baggage(self, tenant: str | None, scene: str | None, cost_center: str | None) -> str | None:
        """The tenant, scene and cost center as W3C baggage (under the first baggage key of each), for
        the engine's record of a request; None when there are none."""
        settings = self.settings
        entries = [
            f"{keys[0]}={quote(value, safe='')}"
            for keys, value in (
                (settings.tenant_baggage_keys, tenant),
                (settings.scene_baggage_keys, scene),
                (settings.cost_center_baggage_keys, cost_center),
            )
            if keys and value
        ]
        return ",".join(entries) or None

    def vouched(self) -> list:
        """Per field, the values the API-key map names (None: no map, any value may get a label)."""
        if not self.api_keys:
            return [None, None, None]
        return [frozenset(v for v in values if v) for values in list(zip(*self.api_keys.values()))[:3]]

    def __call__(self, headers, ctx=None) -> tuple[str | None, str | None, str | None]:
        """(tenant, scene, cost center): from the API key map, else request headers (first match),
        else W3C baggage."""
        return self.caller(headers, ctx)[:3]

    def caller(self, headers, ctx=None) -> Caller:
        """The request's Caller: an API key the map names gives all four; else tenant, scene and cost
        center from the request headers (first match), else W3C baggage, and no key id."""
        found: list[str | None] = [None, None, None]
        headers = first_values(headers)
        if self.api_keys and headers is not None:
            scheme, _, key = (headers.get("authorization") or "").partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                entry = self.api_keys.get(hashlib.sha256(key.strip().encode()).hexdigest())
                if entry is not None:
                    return Caller(*entry)
        settings = self.settings
        limit = settings.attribution_max_length
        if headers is not None:  # (the first non-empty value of each kind's headers)
            checked = self._checked
            raw_dict = type(headers) is _FirstValues and self._header_keys is not None  # (its dict read as it is)
            names_per_kind = (
                self._header_keys
                if raw_dict
                else (settings.tenant_headers, settings.scene_headers, settings.cost_center_headers)
            )
            for index, names in enumerate(names_per_kind):
                if raw_dict:  # (in C: no loop of ours over the names)
                    value = next(filter(None, map(dict.get, repeat(headers), names)), None)
                    if value:
                        value = value.decode("latin-1")
                else:
                    value = _first_header(headers, names)
                if value:
                    valid = checked.get(value, _UNCHECKED) if type(value) is str else _UNCHECKED
                    found[index] = self._valid(value, limit) if valid is _UNCHECKED else valid
        if None in found:
            # baggage.get_all(ctx)'s entries, without the API's frames (otel_llm/sdk/current.py)
            entries = (current.current_context() if ctx is None else ctx).get(current.BAGGAGE_KEY)
            if entries and isinstance(entries, dict):
                baggage_keys = (
                    settings.tenant_baggage_keys,
                    settings.scene_baggage_keys,
                    settings.cost_center_baggage_keys,
                )
                for index, keys in enumerate(baggage_keys):
                    if found[index] is None:
                        found[index] = self._valid(_first_baggage(entries, keys), limit)
        return _new_caller((*found, None, None))

    def request_caller(self, headers, fields=None, *, lenient: bool = False) -> Caller:
        """The Caller of one request: caller(headers), with the end user its fields name (fields(name)
        gives each; None: no fields, no end user). A failure here fails the caller's own guard, or,
        `lenient` (a route's span, made whatever fails), is counted and leaves that part out."""
        try:
            caller = self.caller(headers)
        except Exception:
            if not lenient:
                raise
            failed("reading a request's tenant")  # the request still gets its span and bill, with no tenant
            caller = NO_CALLER
        if fields is None:
            return caller
        try:
            return _new_caller((*caller[:4], self.end_user(fields)))  # (caller._replace(user=...))
        except Exception:
            if not lenient:
                raise
            failed("reading a request's end user")  # the request still gets its span and bill, without it
            return caller

    def end_user(self, get) -> str | None:
        """The end user a request names, get(name) giving its fields: OpenAI's `safety_identifier`, else
        its older `user`. Checked as a tenant value is (attribution_value: the client sets it) and kept
        as sent: the client's own identifier (OpenAI asks for a hash of the user's name or email)."""
        raw = get("safety_identifier")
        if raw is None:
            raw = get("user")
            if raw is None:  # (most requests name none)
                return None
        return self._client_value(raw, "`user` / `safety_identifier`")

    def conversation(self, headers) -> str | None:
        """gen_ai.conversation.id from the first configured conversation header (OTEL_LLM_CONVERSATION_HEADERS)."""
        return self.conversation_value(_first_header(first_values(headers), self.settings.conversation_headers))

    def conversation_value(self, raw) -> str | None:
        """A conversation id the client sent (a header, or vLLM's session id), checked as a tenant value is."""
        return self._client_value(raw, "session / conversation id")

    def _client_value(self, raw, what: str) -> str | None:
        """A value the client chose (attribution_value), or None with one warning per kind."""
        if raw is None:
            return None
        value = attribution_value(raw, self.settings.attribution_max_length)
        if value is None:
            self._warn(
                ("invalid", what),
                "otel-llm: a request's %s was ignored (not a string, over %d characters, "
                "or control characters; %s). Further ones are not logged.",
                what,
                self.settings.attribution_max_length,
                ENV_ATTRIBUTION_MAX_LENGTH,
            )
        return value

    def _valid(self, raw: str | None, limit: int) -> str | None:
        if raw is None:
            return None
        value = attribution_value(raw, limit)
        if len(self._checked) < CHECKED_CACHE and isinstance(raw, str):
            self._checked[raw] = value
        if value is None:
            self._warn(
                "invalid",
                "otel-llm: a tenant/scene/cost-center value was ignored (over %d characters, or "
                "control characters; %s): such requests are attributed to no tenant. Further ones are not "
                "logged.",
                limit,
                ENV_ATTRIBUTION_MAX_LENGTH,
            )
        return value


def first_values(headers):
    """An ASGI scope's header list, or Starlette's Headers, as a mapping of each name's first value, made
    in one pass over the list: Headers' own get() scans it and raises and catches a KeyError for each
    name a request lacks (the tenant, scene and cost-center headers most requests do not send), per
    request. Any other mapping (or None, or a view this made) as it is."""
    if type(headers) is list:  # an ASGI scope's (name, value) byte pairs (contract.read_headers)
        return _FirstValues(reversed(headers))  # (the first of a repeated name is written last: it stays)
    if type(headers) is _FirstValues:
        return headers
    raw = getattr(headers, "raw", None)
    if type(raw) is not list:
        return headers
    return _FirstValues(reversed(raw))


class _FirstValues(dict):
    """Headers.get's answers (the first value of a name, looked up lowercased, as latin-1) from a dict of
    the raw (name, value) byte pairs, made in C; `Attribution.caller` reads that dict itself."""

    __slots__ = ()

    def get(self, name: str, default=None):
        value = dict.get(self, name.lower().encode("latin-1"))
        return default if value is None else value.decode("latin-1")


def _first_header(headers, names) -> str | None:
    if headers is None:
        return None
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None


def _first_baggage(entries, keys) -> str | None:
    for key in keys:
        value = entries.get(key)
        if value:
            return str(value)
    return None


def _load_api_keys(path: str | None) -> dict:
    if not path:
        return {}
    try:
        keys = load_api_keys(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warn_once(
            ("api keys", path),
            "otel-llm: %s %s unusable (%s); tenants come from headers and baggage",
            ENV_API_KEYS_FILE,
            path,
            exc,
        )
        return {}
    return keys


def attribution_value(raw, max_length: int) -> str | None:
    """A tenant / scene / cost-center value as a client sent it, or None when it is not one.

    HTTP headers arrive decoded as latin-1 (the ASGI rule): UTF-8 sent by the client is decoded as
    UTF-8 again (`租户-é`, not `ç§\x9fæ\x88·-Ã©`). Surrounding blanks are dropped. A value longer
    than max_length characters or holding control / format characters is refused whole (cut, two
    tenants could become one bill)."""
    if not isinstance(raw, str):
        return None
    value = raw.strip()
    if not value.isascii():
        try:
            value = value.encode("latin-1").decode("utf-8")
        except UnicodeError:
            pass  # not UTF-8 sent as bytes: keep it as it came
    if not value or len(value) > max_length:
        return None
    if not value.isprintable():  # control, format, separators other than the plain space
        return None
    return value


@dataclass
class LabelGuard:
    """Keeps a metric label low-cardinality: values in the allow-list keep their name; without one,
    the first N distinct values do, among those the API-key map vouches for when there is one (so
    clients sending made-up tenant headers cannot take the slots of real tenants); the rest 'other'."""

    allow_list: tuple[str, ...] = ()
    limit: int = 50
    vouched: frozenset[str] | None = None
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, value: str | None) -> str | None:
        if value is None:
            return None
        if self.allow_list:
            return value if value in self.allow_list else semconv.LABEL_OTHER
        if self.vouched is not None and value not in self.vouched:
            return semconv.LABEL_OTHER
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return semconv.LABEL_OTHER


def load_api_keys(path: str) -> dict[str, ApiKey]:
    """sha256 hex digest of an API key -> its ApiKey (tenant, scene, cost center, id). Raises ValueError."""
    with open(path) as f:
        entries = json.load(f)["keys"]
    keys = {}
    for entry in entries:
        digest = str(entry["sha256"]).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"not a sha256 hex digest: {digest[:12]}...")
        key_id = entry.get("id") or digest[:KEY_ID_LENGTH]
        if not isinstance(key_id, str) or not key_id.isprintable() or key_id.strip() != key_id:
            raise ValueError(f"the id of key {digest[:KEY_ID_LENGTH]}... is not a printable string")
        if hashlib.sha256(key_id.encode()).hexdigest() == digest:  # it would be exported
            raise ValueError(f"the id of key {digest[:KEY_ID_LENGTH]}... is the key itself")
        keys[digest] = ApiKey(str(entry["tenant"]), entry.get("scene"), entry.get("cost_center"), key_id)
    return keys
