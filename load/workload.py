"""Deterministic benchmark workloads: pseudo-sentences to embed and Poisson arrival times."""

from __future__ import annotations

import random

_WORDS = (
    "the a of to and in that is for it as with was on be by at this have from or one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some so these "
    "would other into has more her two like him see time could no make than first been its who now people my made "
    "over did down only way find use may water long little very after words called just where most know get through "
    "back much before go good new write our used me man too any day same right look think also around another came "
    "come work three word must because does part even place well such here take why things help put years different "
    "away again off went old number great tell men say small every found still between name should home big give air "
    "line set own under read last never us left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head above kind began almost "
    "live page got earth need far hand high year mother light parts country father let night following picture being "
    "study second eyes soon times story boys since white days ever paper hard near sentence better best across during "
    "today others however sure means knew it's try told young miles sun ways thing whole hear example heard several "
    "change answer room sea against top turned learn point city play toward five using himself usually money seen "
    "embedding vector batch latency queue model service request provider token index search document retrieval"
).split()


def pseudo_sentences(count: int, mean_chars: int = 120, seed: int = 0) -> list[str]:
    """``count`` distinct sentences of random common words, lengths uniform in ``mean_chars`` +/- 50%.

    The same arguments always give the same list, so every strategy of a run embeds the same texts.
    """
    if count < 0 or mean_chars < 2:
        raise ValueError("count must be >= 0 and mean_chars >= 2")
    rng = random.Random(seed)
    texts: list[str] = []
    seen: set[str] = set()
    while len(texts) < count:
        target = rng.randint(mean_chars // 2, mean_chars + mean_chars // 2)
        words: list[str] = []
        length = -1
        while length + 4 < target:  # the last word overshoots the target by half a word on average
            word = rng.choice(_WORDS)
            words.append(word)
            length += len(word) + 1
        text = " ".join(words)
        text = text[:1].upper() + text[1:] + "."
        if text not in seen:
            seen.add(text)
            texts.append(text)
    return texts


def poisson_arrivals(rate_per_s: float, max_count: int, max_duration_s: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process at ``rate_per_s``.

    Arrivals stop at ``max_count`` or when the next one would come after ``max_duration_s``, whichever is first.
    """
    if rate_per_s <= 0 or max_count < 0 or max_duration_s < 0:
        raise ValueError("rate_per_s must be > 0; max_count and max_duration_s >= 0")
    rng = random.Random(seed)
    offsets: list[float] = []
    now = 0.0
    while len(offsets) < max_count:
        now += rng.expovariate(rate_per_s)
        if now > max_duration_s:
            break
        offsets.append(now)
    return offsets
