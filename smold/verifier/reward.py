"""Harbor-style reward files: reward.txt holds one number, reward.json a number or an object of numbers."""

from __future__ import annotations

import json
import math

from .errors import RewardFormatError

MAX_REWARD_FILE_BYTES = 1 << 20


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardFormatError(f"{what} is not a number: {json.dumps(value)[:80]}")
    if not math.isfinite(value):
        raise RewardFormatError(f"{what} is not a finite number: {value}")
    return float(value)


def parse_reward(path: str, data: bytes) -> float:
    """The reward a reward file holds.

    - `*.json`: a JSON number, or an object: its "reward" member if present, else the mean of all its
      members (each must be a number; an empty object is an error).
    - anything else (reward.txt): one number (Python float syntax, surrounding whitespace ignored).
    Non-finite values (nan, inf) are errors: a reward must be comparable with a threshold.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RewardFormatError("reward file is not UTF-8 text") from None
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise RewardFormatError(f"reward file is not valid JSON: {e}") from None
        if isinstance(doc, dict):
            if "reward" in doc:
                return _finite(doc["reward"], '"reward"')
            if not doc:
                raise RewardFormatError('reward JSON is an empty object (expected "reward" or numbers)')
            values = [_finite(v, json.dumps(k)) for k, v in doc.items()]
            return math.fsum(values) / len(values)
        return _finite(doc, "reward JSON")
    stripped = text.strip()
    if not stripped:
        raise RewardFormatError("reward file is empty")
    try:
        value = float(stripped)
    except ValueError:
        raise RewardFormatError(f"reward file is not a number: {stripped[:80]!r}") from None
    return _finite(value, "reward")
