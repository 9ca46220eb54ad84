"""Redaction of captured prompt and completion text, before anything leaves the process.

The built-in rules run as one RE2 alternation (google-re2: time linear in the text whatever it
holds, the same syntax as the collector's second line): secrets first (otel_llm/secret_rules.py:
one row per format, with its source), then e-mail addresses, PRC resident ID numbers (check
digit), payment card numbers (Luhn checked), phone numbers, IPv4 and IPv6 addresses (checked by
`ipaddress`). At one position the first rule that matches and passes its check wins; a candidate
that fails its check is left as it is. Each match becomes a typed token (`<SECRET>`, `<EMAIL>`,
...) so that a reader still sees what kind of thing was there; redactions are counted per rule
(`secret.<format>` for secrets).

User rules (`OTEL_LLM_REDACTION_RULES`, a JSON file: `[{"name", "pattern", "replacement"}]`, Python
`re` syntax) run after the built-in ones, on their result; Python callables registered in the
entry-point group `otel_llm_redactors` (`text -> text`) run last. A rule that fails to load is
skipped with one warning; a callable that raises leaves the text as the rules before it made it.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import os
import re
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import re2

from otel_llm import secret_rules, semconv
from otel_llm.config import ENV_REDACTION_RULES, redaction_rules_file
from otel_llm.warn import WarnOnce

_log = logging.getLogger("otel_llm.redaction")

ENTRY_POINT_GROUP = "otel_llm_redactors"

_PRC_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_PRC_ID_CHECK = "10X98765432"


# the sum of a doubled digit's digits, for each digit
_LUHN_DOUBLED = {str(d): (2 * d) // 10 + (2 * d) % 10 for d in range(10)}
_LUHN_PLAIN = {str(d): d for d in range(10)}
_CARD_SEPARATORS = str.maketrans("", "", " -")


def luhn_valid(number: str) -> bool:
    digits = number.translate(_CARD_SEPARATORS)
    if not (13 <= len(digits) <= 19 and digits.isascii() and digits.isdigit()):
        return False
    # (Luhn-invalid cards back to back are a candidate every 5 characters: kept to ~1 us each)
    return (
        sum(map(_LUHN_PLAIN.__getitem__, digits[-1::-2])) + sum(map(_LUHN_DOUBLED.__getitem__, digits[-2::-2]))
    ) % 10 == 0


def prc_id_valid(number: str) -> bool:
    """GB 11643-1999: 17 digits (region, birth date, sequence) and an ISO 7064 MOD 11-2 check."""
    if len(number) != 18 or not number[:17].isdigit():
        return False
    month, day = int(number[10:12]), int(number[12:14])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return False
    check = _PRC_ID_CHECK[sum(int(c) * w for c, w in zip(number, _PRC_ID_WEIGHTS)) % 11]
    return number[17].upper() == check


def _ip_valid(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Rule:
    """A redaction rule. Built-in rules are RE2 (`re2=True`): `pattern` has no lookaround; `left`
    lists the characters that may not stand right before a match (a match starts only where a run of
    them starts), `after` is RE2 that must follow a match (not replaced); a `(?P<secret>...)` group,
    if any, is the only part replaced. Other rules are Python `re` (user rules), run after the RE2
    ones on their result; `gate` and `starts` speed those up."""

    name: str
    pattern: str
    replacement: str
    check: Callable[[str], bool] | None = None
    # a cheap test a text must pass for the rule to be tried on it at all (None: always tried)
    gate: Callable[[str], bool] | None = None
    # a character class every match starts with: when all rules tried on a text have one, the
    # search jumps from candidate to candidate instead of trying every rule at every position
    starts: str | None = None
    left: str | None = None
    after: str | None = None
    re2: bool = False
    head: str | None = None  # RE2 every match starts with (default: the pattern's literal head)


def _right(chars: str | None) -> str | None:
    """RE2 for "not followed by one of `chars`" (the character after is consumed, not replaced)."""
    return f"(?:[^{chars}]|$)" if chars else None


def secret_rule_name(name: str) -> str:
    """The otel_llm.redaction.rule value of a row of the secret rule table: secret.<row name>."""
    return f"{semconv.REDACTION_RULE_SECRET}.{name}"


def _secret(rule: secret_rules.SecretRule) -> Rule:
    return Rule(
        secret_rule_name(rule.name),
        rule.pattern,
        "<SECRET>",
        rule.check,
        left=rule.left,
        after=_right(rule.right),
        re2=True,
        head=rule.head,
    )


def _pii(name, pattern, replacement, check=None, *, left, right=None, after=None, head=None) -> Rule:
    """A PII rule; its head is the whole (bounded) pattern unless given."""
    return Rule(
        name, pattern, replacement, check, left=left, after=after or _right(right), re2=True, head=head or pattern
    )


# Order matters: at one position the first rule that matches and passes its check wins (an 18-digit
# number is an ID if its check digit says so, else perhaps a card; a card is not read as a phone).
# Cards by their real groupings only (13-19 digits; 4-4-4-4[-1..3] with one kind of separator; Amex
# 4-6-5 and Diners 4-6-4), so that a run of digits and blanks is never read in many ways.
# numbers glued to letters (hex hashes, UUIDs, identifiers) are not numbers of their own
_NUM = "0-9A-Za-z_"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rf"(?:{_OCTET}\.){{3}}{_OCTET}"
_H = "[0-9A-Fa-f]{1,4}"
BUILTIN_RULES = (
    *map(_secret, secret_rules.RULES),
    _pii(
        semconv.REDACTION_RULE_EMAIL,
        r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b",
        "<EMAIL>",
        left="A-Za-z0-9._%+-",
    ),
    _pii(
        semconv.REDACTION_RULE_PRC_ID,
        r"[0-9]{10}(?:0[1-9]|1[0-2])(?:0[1-9]|[12][0-9]|3[01])[0-9]{3}[0-9Xx]",
        "<NATIONAL_ID>",
        prc_id_valid,
        left=_NUM,
        right="0-9A-Za-z",
    ),
    _pii(
        semconv.REDACTION_RULE_PAYMENT_CARD,
        r"[0-9]{13,19}|[0-9]{4}(?: [0-9]{4}){3}(?: [0-9]{1,3})?|[0-9]{4}(?:-[0-9]{4}){3}(?:-[0-9]{1,3})?"
        r"|[0-9]{4} [0-9]{6} [0-9]{4,5}|[0-9]{4}-[0-9]{6}-[0-9]{4,5}",
        "<PAYMENT_CARD>",
        luhn_valid,
        left=_NUM + "-",
        right=_NUM + "-",
    ),
    _pii(
        semconv.REDACTION_RULE_PHONE,
        r"\+[0-9]{1,3}[ .-]?(?:\([0-9]{1,4}\)[ .-]?)?[0-9]{1,4}(?:[ .-]?[0-9]{2,4}){1,4}",
        "<PHONE>",
        left="A-Za-z0-9_+",
        right=_NUM,
    ),
    _pii(semconv.REDACTION_RULE_PHONE, r"\([0-9]{3}\)[ .-]?[0-9]{3}[ .-][0-9]{4}", "<PHONE>", left=_NUM, right=_NUM),
    _pii(
        semconv.REDACTION_RULE_PHONE, r"[0-9]{3}[.-][0-9]{3}[.-][0-9]{4}", "<PHONE>", left=_NUM + "-", right=_NUM + "-"
    ),
    _pii(semconv.REDACTION_RULE_PHONE, r"1[3-9][0-9][ -]?[0-9]{4}[ -]?[0-9]{4}", "<PHONE>", left=_NUM, right=_NUM),
    _pii(
        semconv.REDACTION_RULE_IP_ADDRESS,
        _IPV4,
        "<IP_ADDRESS>",
        _ip_valid,
        left=_NUM + ".",
        after=r"(?:[^0-9A-Za-z_.]|\.[^0-9]|\.?$)",
    ),
    _pii(
        semconv.REDACTION_RULE_IP_ADDRESS,
        rf"(?:{_H}:){{1,7}}(?::|(?::{_H}){{1,7}}|{_H})|::(?:{_H}(?::{_H}){{0,6}})?",
        "<IP_ADDRESS>",
        _ip_valid,
        left="A-Za-z0-9_:",
        right="A-Za-z0-9_:",
    ),
)


def _options(capture: bool) -> re2.Options:
    options = re2.Options()
    options.max_mem = 64 << 20  # the DFA's cache: enough that a big alternation never falls back to the NFA
    options.never_capture = not capture
    return options


def _split_top(pattern: str) -> list[str]:
    """The top-level alternatives of an RE2 pattern."""
    bars = [i for i, c, depth in secret_rules.scan(pattern) if c == "|" and depth == 0]
    return [pattern[a + 1 : b] for a, b in zip([-1, *bars], [*bars, len(pattern)])]


def _head(alternative: str) -> str:
    """The part of an alternative before its first repeated class or group (`*`, `+`, `{`) or its
    secret group: what every match of it starts with, short and bounded; the whole alternative if
    that part is empty."""
    i = 0
    while i < len(alternative):
        c = alternative[i]
        if alternative.startswith("(?P<secret>", i):
            break
        if c == "\\":
            end = i + 2
        elif c == "[":
            end = secret_rules.class_end(alternative, i)
        elif c == "(":  # after its closing parenthesis
            end = next(j for j, _, depth in secret_rules.scan(alternative, i) if depth == 0) + 1
        else:
            end = i + 1
        if alternative[end : end + 1] in ("*", "+", "{"):
            break
        i = end + (alternative[end : end + 1] == "?")
    return alternative[:i] or alternative


def _head_of(rule: Rule) -> str:
    return rule.head or "|".join(_head(a) for a in _split_top(rule.pattern))


def _alternative(rule: Rule) -> str:
    """A rule as RE2 run on the text after a newline (which stands for the start of the text): the
    character before the match is consumed, so that no lookbehind is needed."""
    left = f"[^{rule.left}]" if rule.left else "(?s:.)"
    return f"{left}(?P<match>{rule.pattern}){rule.after or ''}"


class _Program:
    """A compiled RE2 regex run on bytes, giving the (start, end) of each group straight from the
    compiled program: google-re2's Python wrapper builds a generator and a match object per call
    (2-3 us), which text dense with near misses pays per candidate. Where the compiled program is not
    reachable as expected (another google-re2 release), its public API gives the same spans."""

    def __init__(self, pattern: str, capture: bool):
        self.regex = re2.compile(pattern, _options(capture))
        self.groupindex = self.regex.groupindex
        self._raw = None  # (any other release: the public API)
        try:
            raw, anchor = self.regex._regexp.Match, re2._Anchor
            unanchored, start = anchor.UNANCHORED, anchor.ANCHOR_START
            if raw(unanchored, b"\n" * 3, 0, 3) is not None:  # (answers at all, in the shape used below)
                self._raw, self._unanchored, self._start = raw, unanchored, start
        except Exception:  # noqa: BLE001, S110
            pass

    def search_start(self, data: bytes, pos: int) -> int | None:
        """Where the first match at or after `pos` starts; None if there is none."""
        if self._raw is not None:
            begin = self._raw(self._unanchored, data, pos, len(data))[0][0]
            return None if begin < 0 else begin
        m = self.regex.search(data, pos)
        return None if m is None else m.start()

    def match_spans(self, data: bytes, pos: int) -> list[tuple[int, int]] | None:
        """The spans of every group ((-1, -1): did not take part) of the match starting at `pos`."""
        if self._raw is not None:
            spans = self._raw(self._start, data, pos, len(data))
            return None if spans[0][0] < 0 else spans
        m = self.regex.match(data, pos)
        return None if m is None else [m.span(g) for g in range(self.regex.groups + 1)]


class _Alternation:
    """A list of RE2 rules, searched in two steps, each an RE2 DFA over few states whatever the text:
    `finder` finds where a match can start (each rule's short head after its left context), then an
    RE2 set anchored there tells which rules match from there (in rule order, the first is the
    leftmost-first match); each rule's own regex gives the parts of its match."""

    WINDOW = 8192  # bytes the set reads from a candidate: more than any rule's shortest match

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.finder = _Program(
            "|".join(
                f"[^{rule.left}](?:{_head_of(rule)})" if rule.left else f"(?s:.)(?:{_head_of(rule)})" for rule in rules
            ),
            capture=False,
        )
        self.starting = re2.Set.MatchSet(_options(capture=False))
        for rule in rules:
            self.starting.Add(_alternative(rule))
        self.starting.Compile()
        self.own = [_Program(_alternative(rule), capture=True) for rule in rules]
        # (group of the match, group of the part to replace) per rule
        self.groups = [(rx.groupindex["match"], rx.groupindex.get("secret", rx.groupindex["match"])) for rx in self.own]

    def matches_at(self, data: bytes, at: int):
        """(rule index, start of its match, start and end of the part to replace) of each rule that
        matches at `at` (its consumed character), in rule order."""
        for i in sorted(self.starting.Match(data[at : at + self.WINDOW]) or ()):
            spans = self.own[i].match_spans(data, at)
            if spans is not None:  # (None: the window's end looked like the text's end to the set)
                match, secret = self.groups[i]
                yield i, spans[match][0], spans[secret][0], spans[secret][1]


class Redactor:
    """Replaces what its rules match. Stateless per call: safe to share between threads."""

    def __init__(self, rules: Iterable[Rule] = BUILTIN_RULES, callables: Iterable[Callable[[str], str]] = ()):
        self.rules = tuple(rules)
        self.callables = tuple(callables)
        self._re2_rules = [r for r in self.rules if r.re2]
        self._first = _Alternation(self._re2_rules) if self._re2_rules else None
        specific = {secret_rule_name(n) for n in secret_rules.SPECIFIC}
        specific_rules = [r for r in self._re2_rules if r.name in specific]
        self._specific = _Alternation(specific_rules) if specific_rules else None
        self._refined = {secret_rule_name(n) for n in secret_rules.REFINED}
        self._py_rules = tuple(r for r in self.rules if not r.re2)
        self._each = [re.compile(rule.pattern) for rule in self._py_rules]
        self._gates = [(i, rule.gate) for i, rule in enumerate(self._py_rules) if rule.gate]
        self._ungated = frozenset(i for i, rule in enumerate(self._py_rules) if not rule.gate)
        self._combined: dict[frozenset, tuple] = {}
        self._warn = WarnOnce(_log)  # per redactor

    def redact(self, text: str) -> str:
        return self.redact_counted(text)[0]

    def redact_counted(self, text: str) -> tuple[str, Counter]:
        """The redacted text and the replacements made, per rule name."""
        found: Counter[str] = Counter()
        if not text:
            return text, found
        if self._first is not None:
            text = self._redact_re2(text, found)
        if self._py_rules:
            text = self._redact_py(text, found)
        for fn in self.callables:
            try:
                redacted = fn(text)
            except Exception:  # noqa: BLE001 - a user's redactor must not break the request
                self._warn_once(repr(fn), "otel-llm: redactor %r failed; text left as the rules before it made it", fn)
                continue
            if isinstance(redacted, str):
                if redacted != text:
                    found[getattr(fn, "__name__", "callable")] += 1
                text = redacted
        return text, found

    # ---- the built-in (RE2) rules ----------------------------------------------------------------

    def _redact_re2(self, text: str, found: Counter) -> str:
        """One left-to-right pass. Every alternative consumes the character before its match (the text
        is searched after a newline, as its start), so a search from pos - 1 finds exactly the matches
        that start at pos or later, with the character at pos - 1 as their left context. At one place
        the first rule that matches and passes its check wins."""
        data = b"\n" + text.encode("utf-8", "surrogatepass")
        out: list[bytes] = []
        done = pos = 1
        finder = self._first.finder
        while (at := finder.search_start(data, pos - 1)) is not None:
            hit = self._accept(data, at)
            if hit is None:  # no rule matches here, or none whose check passes: look further on
                pos = at + 2  # (the match proper starts after the consumed character)
                continue
            rule, start, end = hit
            found[rule.name] += 1
            out.append(data[done:start])
            out.append(rule.replacement.encode())
            done = pos = end
        if not out:
            return text
        out.append(data[done:])
        return b"".join(out).decode("utf-8", "surrogatepass")

    def _accept(self, data: bytes, at: int) -> tuple[Rule, int, int] | None:
        """(rule, start, end of what to replace) of the first rule that matches at `at` (its consumed
        character) and passes its check; None if none does."""
        for i, _, start, end in self._first.matches_at(data, at):
            rule = self._re2_rules[i]
            if rule.check is None or rule.check(data[start:end].decode("utf-8", "surrogatepass")):
                if rule.name in self._refined:
                    rule = self._specific_rule(data, start, end) or rule
                return rule, start, end
        return None

    def _specific_rule(self, data: bytes, start: int, end: int) -> Rule | None:
        """The format rule whose match is exactly data[start:end] and passes its check (an assignment's
        or a header's value that is a known key format is counted under that format)."""
        if self._specific is None:
            return None
        value = b"\n" + data[start:end] + b"\n"
        for i, match_start, secret_start, secret_end in self._specific.matches_at(value, 0):
            rule = self._specific.rules[i]
            if (match_start, secret_start, secret_end) == (1, 1, len(value) - 1) and (
                rule.check is None or rule.check(data[start:end].decode("utf-8", "surrogatepass"))
            ):
                return rule
        return None

    # ---- user rules (Python re) ------------------------------------------------------------------

    def _regex_for(self, text: str) -> tuple:
        """(one alternation of the rules whose gate the text passes, the search for where their
        matches can start, if every one of them says): compiled once per set of rules."""
        active = self._ungated | {i for i, gate in self._gates if gate(text)}
        found = self._combined.get(active)
        if found is None:
            rules = [self._py_rules[i] for i in sorted(active)]
            combined = (
                re.compile("|".join(f"(?P<r{i}>{self._py_rules[i].pattern})" for i in sorted(active)))
                if active
                else None
            )
            finder = re.compile("|".join(r.starts for r in rules)) if rules and all(r.starts for r in rules) else None
            found = self._combined[active] = (combined, finder)
        return found

    def _redact_py(self, text: str, found: Counter) -> str:
        out = []
        pos = 0
        combined, finder = self._regex_for(text)
        while (match := self._next(text, pos, combined, finder)) is not None:
            start = match.start()
            hit = self._accept_py(text, start, match)
            if hit is None:  # no rule's check passed here: keep the character, look further on
                out.append(text[pos : start + 1])
                pos = start + 1
                continue
            rule, end = hit
            found[rule.name] += 1
            out.append(text[pos:start])
            out.append(rule.replacement)
            pos = end
        if out:
            out.append(text[pos:])
            text = "".join(out)
        return text

    @staticmethod
    def _next(text: str, pos: int, combined: re.Pattern | None, finder: re.Pattern | None) -> re.Match | None:
        if combined is None:
            return None
        if finder is None:
            return combined.search(text, pos)
        while (candidate := finder.search(text, pos)) is not None:
            match = combined.match(text, candidate.start())
            if match is not None:
                return match
            pos = candidate.start() + 1
        return None

    def _accept_py(self, text: str, start: int, match: re.Match) -> tuple[Rule, int] | None:
        """The rule that matched at `start` if its check passes, else the first later rule that
        matches there and passes its own."""
        index = int(match.lastgroup[1:])
        rule = self._py_rules[index]
        if rule.check is None or rule.check(match.group()):
            return rule, match.end()
        for later, regex in zip(self._py_rules[index + 1 :], self._each[index + 1 :]):  # (gated out: no match)
            m = regex.match(text, start)
            if m is not None and (later.check is None or later.check(m.group())):
                return later, m.end()
        return None

    def _warn_once(self, key: str, message: str, *args) -> None:
        self._warn(key, message, *args, exc_info=True)


def _user_rules(path: str) -> list[Rule]:
    try:
        with open(path, encoding="utf-8") as f:
            items = json.load(f)
    except (OSError, ValueError) as e:
        _log.warning(
            "otel-llm: %s=%s could not be read (%s); only the built-in redaction rules apply",
            ENV_REDACTION_RULES,
            path,
            e,
        )
        return []
    rules = []
    for i, item in enumerate(items if isinstance(items, list) else []):
        try:
            name, pattern = str(item["name"]), str(item["pattern"])
            re.compile(pattern)
            rules.append(Rule(name, f"(?:{pattern})", str(item.get("replacement", f"<{name.upper()}>"))))
        except (KeyError, TypeError, re.error) as e:
            _log.warning("otel-llm: redaction rule %d in %s skipped (%s)", i, path, e)
    if not isinstance(items, list):
        _log.warning("otel-llm: %s must hold a JSON list of {name, pattern, replacement}", path)
    return rules


def _entry_point_callables() -> list[Callable[[str], str]]:
    from importlib.metadata import entry_points

    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            fn = ep.load()
        except Exception:  # noqa: BLE001 - a broken plug-in must not break telemetry
            _log.warning("otel-llm: redactor entry point %s could not be loaded; skipped", ep.name, exc_info=True)
            continue
        if callable(fn):
            found.append(fn)
    return found


def from_environment(environ=os.environ) -> Redactor:
    """The built-in rules, the user's rules file and the entry-point callables."""
    path = redaction_rules_file(environ)
    return Redactor((*BUILTIN_RULES, *(_user_rules(path) if path else ())), _entry_point_callables())


@functools.cache
def default() -> Redactor:
    """This process's redactor (from_environment(), made once): for text that leaves the process
    whether or not content capture is on (exception messages, error descriptions)."""
    return from_environment()


# ---- error text ---------------------------------------------------------------------------------

# An error's text (exception message, stacktrace, status description) is redacted before it leaves,
# whether or not content capture is on: a provider's error can echo the key it was sent, the model
# name it was asked for or the prompt.
# The redactor reads at most this many characters of it (its time is bounded by its input's length).
MAX_ERROR_TEXT = 16_384
# exception stacktraces: the end (where the exception and its message are) is kept
MAX_STACKTRACE = 65_536


def redacted_error(text: str, limit: int = MAX_ERROR_TEXT, keep_end: bool = False) -> str:
    """`text` with whatever the process's redactor (redaction.default()) matches replaced, from at
    most `limit` characters of it (its start, or its end with keep_end). A cut drops the partial word
    at the cut first: part of a key that no rule would recognise any more must not remain."""
    if len(text) > limit:
        if keep_end:
            text = text[-limit:]
            cut = min((i for i in (text.find(c) for c in " \n") if i >= 0), default=len(text))
            text = "…" + text[cut:]
        else:
            text = text[:limit]
            cut = max(text.rfind(" "), text.rfind("\n"))
            text = (text[:cut] if cut > 0 else "") + "…"
    return default().redact(text)


def exception_attributes(exc: BaseException) -> dict[str, str]:
    """exception.message and exception.stacktrace for span.record_exception(exc, attributes=...),
    which take the SDK's own values' place: redacted (redacted_error)."""
    stacktrace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "exception.message": redacted_error(str(exc)),
        "exception.stacktrace": redacted_error(stacktrace, MAX_STACKTRACE, keep_end=True),
    }
