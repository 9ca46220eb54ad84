"""Redaction of captured prompt and completion text, before anything leaves the process.

One pass over the text with one compiled alternation (Python's `re` tries the alternatives in
order at each position): secrets first, then e-mail addresses, payment card numbers (Luhn
checked), PRC resident ID numbers (check digit), phone numbers, IPv4 and IPv6 addresses (checked
by `ipaddress`). A candidate that fails its check is left as it is. Each match becomes a typed
token (`<EMAIL>`, `<PHONE>`, ...) so that a reader still sees what kind of thing was there.

User rules (`OTEL_LLM_REDACTION_RULES`, a JSON file: `[{"name", "pattern", "replacement"}]`) run
after the built-in ones; Python callables registered in the entry-point group
`otel_llm_redactors` (`text -> text`) run last. A rule that fails to load is skipped with one
warning; a callable that raises leaves the text as the rules before it made it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from otel_llm import semconv
from otel_llm.config import ENV_REDACTION_RULES, redaction_rules_file
from otel_llm.warn import WarnOnce

_log = logging.getLogger("otel_llm.redaction")

ENTRY_POINT_GROUP = "otel_llm_redactors"

_PRC_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_PRC_ID_CHECK = "10X98765432"


def luhn_valid(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def prc_id_valid(number: str) -> bool:
    """GB 11643-1999: 17 digits (region, birth date, sequence) and an ISO 7064 MOD 11-2 check."""
    if len(number) != 18 or not number[:17].isdigit():
        return False
    month, day = int(number[10:12]), int(number[12:14])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return False
    check = _PRC_ID_CHECK[sum(int(c) * w for c, w in zip(number, _PRC_ID_WEIGHTS)) % 11]
    return number[17].upper() == check


def _has_digit(text: str) -> bool:
    return any(d in text for d in "0123456789")  # ten memchr scans: far cheaper than a regex


def _may_hold_secret(text: str) -> bool:
    return any(s in text for s in ("_", "k-", "earer ", "AKIA", "xox", "AIza", "eyJ"))


def _ip_valid(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: str
    replacement: str
    check: Callable[[str], bool] | None = None
    # a cheap test a text must pass for the rule to be tried on it at all (None: always tried)
    gate: Callable[[str], bool] | None = None
    # a character class every match starts with: when all rules tried on a text have one, the
    # search jumps from candidate to candidate instead of trying every rule at every position
    starts: str | None = None


def _ascii(pattern: str) -> str:
    """\\b, \\w and \\d in ASCII's sense: in Unicode's, a letter of another script is a word character,
    so `密钥sk-...` or `邮箱jane@...` has no word boundary before the secret and it would leak whole
    (or the e-mail's first part would)."""
    return f"(?a:{pattern})"


# Order matters: at one position the first rule that matches and passes its check wins (an 18-digit
# number is an ID if its check digit says so, else perhaps a card; a card is not read as a phone).
BUILTIN_RULES = (
    Rule(semconv.REDACTION_RULE_SECRET,
         _ascii(r"(?<=(?i:bearer) )[A-Za-z0-9._~+/=-]{8,}"
         r"|\b(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_]{16,}"
         r"|\bAKIA[0-9A-Z]{16}\b"
         r"|\bgh[pousr]_[A-Za-z0-9]{36,}"
         r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"
         r"|\bAIza[0-9A-Za-z_-]{35}"
         r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
         "<SECRET>", gate=_may_hold_secret),
    Rule(semconv.REDACTION_RULE_EMAIL,
         _ascii(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"), "<EMAIL>",
         gate=lambda text: "@" in text),
    Rule(semconv.REDACTION_RULE_PRC_ID, _ascii(r"(?<!\d)\d{17}[\dXx](?![\dA-Za-z])"), "<NATIONAL_ID>", prc_id_valid,
         gate=_has_digit,
         starts=r"\d"),
    Rule(semconv.REDACTION_RULE_PAYMENT_CARD,
         _ascii(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])"), "<PAYMENT_CARD>", luhn_valid, gate=_has_digit,
         starts=r"\d"),
    Rule(semconv.REDACTION_RULE_PHONE,
         _ascii(r"(?<![\w+])\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){1,4}(?!\d)"
         r"|(?<!\d)\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}(?!\d)"
         r"|(?<![\d-])\d{3}[.-]\d{3}[.-]\d{4}(?![\d-])"
         r"|(?<!\d)1[3-9]\d[ -]?\d{4}[ -]?\d{4}(?!\d)"),
         "<PHONE>", gate=_has_digit, starts=r"[\d+(]"),
    Rule(semconv.REDACTION_RULE_IP_ADDRESS, _ascii(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?!\d|\.\d)"), "<IP_ADDRESS>",
         _ip_valid,
         gate=lambda text: "." in text and _has_digit(text), starts=r"\d"),
    Rule(semconv.REDACTION_RULE_IP_ADDRESS,
         _ascii(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){1,7}(?::|(?::[0-9A-Fa-f]{1,4}){1,7}|[0-9A-Fa-f]{1,4})(?![\w:])"
         r"|(?<![\w:])::(?:[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){0,6})?(?![\w:])"),
         "<IP_ADDRESS>", _ip_valid, gate=lambda text: text.count(":") >= 2),
)


class Redactor:
    """Replaces what its rules match. Stateless per call: safe to share between threads."""

    def __init__(self, rules: Iterable[Rule] = BUILTIN_RULES, callables: Iterable[Callable[[str], str]] = ()):
        self.rules = tuple(rules)
        self.callables = tuple(callables)
        self._each = [re.compile(rule.pattern) for rule in self.rules]
        self._gates = [(i, rule.gate) for i, rule in enumerate(self.rules) if rule.gate]
        self._ungated = frozenset(i for i, rule in enumerate(self.rules) if not rule.gate)
        self._combined: dict[frozenset, tuple] = {}
        self._warn = WarnOnce(_log)  # per redactor

    def _regex_for(self, text: str) -> tuple:
        """(one alternation of the rules whose gate the text passes, the search for where their
        matches can start, if every one of them says): compiled once per set of rules."""
        active = self._ungated | {i for i, gate in self._gates if gate(text)}
        found = self._combined.get(active)
        if found is None:
            rules = [self.rules[i] for i in sorted(active)]
            combined = re.compile("|".join(f"(?P<r{i}>{self.rules[i].pattern})" for i in sorted(active))) \
                if active else None
            finder = re.compile("|".join(r.starts for r in rules)) \
                if rules and all(r.starts for r in rules) else None
            found = self._combined[active] = (combined, finder)
        return found

    def redact(self, text: str) -> str:
        return self.redact_counted(text)[0]

    def redact_counted(self, text: str) -> tuple[str, Counter]:
        """The redacted text and the replacements made, per rule name."""
        found: Counter[str] = Counter()
        if not text:
            return text, found
        out = []
        pos = 0
        combined, finder = self._regex_for(text)
        while (match := self._next(text, pos, combined, finder)) is not None:
            start = match.start()
            hit = self._accept(text, start, match)
            if hit is None:  # no rule's check passed here: keep the character, look further on
                out.append(text[pos:start + 1])
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

    def _accept(self, text: str, start: int, match: re.Match) -> tuple[Rule, int] | None:
        """The rule that matched at `start` if its check passes, else the first later rule that
        matches there and passes its own."""
        index = int(match.lastgroup[1:])
        rule = self.rules[index]
        if rule.check is None or rule.check(match.group()):
            return rule, match.end()
        for later, regex in zip(self.rules[index + 1:], self._each[index + 1:]):  # (gated out: no match)
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
        _log.warning("otel-llm: %s=%s could not be read (%s); only the built-in redaction rules apply",
                     ENV_REDACTION_RULES, path, e)
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
