"""The bundled corpora: seeded generators of our own text (free of any licence), one document per line.

- ``commopt_tiny`` (~2.3 MB): short stories with consistent entities and arithmetic ("Mia has 3
  apples. Leo gives her 2 more. Now Mia has 5 apples.") so that a tiny model has structure to learn
  beyond word frequencies. A 1M-parameter model learns it within ~150 steps and its loss then
  flattens: right for the quickstart and the tests, too easy to rank optimizers.
- ``commopt_world`` (80,000 documents, ~48 MB, ~11 M tokens with the 0.2.2 tokenizer): a generated world whose facts stay fixed across documents: 400 people,
  each with a home town, a trade, an animal, a colour and an age; 48 towns joined by roads of fixed
  lengths; markets with fixed prices. Documents state facts in varied wordings and tell events
  whose numbers follow from them (costs = count × the town's price, distances summed along a
  trip). People, towns and goods are drawn Zipf-like, so a few facts recur often and most are
  rare: the loss keeps falling as a model memorizes more of the long tail and more of the
  arithmetic, which makes it the corpus of the optimizer quality study (``scripts/convergence.py``).
  Enough documents that the study's longest runs (cpu_tiny at 20 tokens per parameter, ~4.7 M
  tokens; twice that for a time-to-loss budget) read none twice, on any data-parallel degree: past a
  first epoch the training loss rewards memorizing text already seen.

Each training corpus has a held-out twin, ``<name>_heldout`` (:data:`HELD_OUT`): documents of the
same world (the same facts; for ``commopt_tiny`` the same story grammar) drawn from a random stream
of their own, with any document that also occurs in the training corpus left out. It is the
``[validation]`` dataset of the CPU configs and of the quality study, and never a ``[training]`` one
(the config check refuses it).

Every generator is a pure function of its seed: the same text on every machine and Python 3.11
patch release (``random.Random`` with integer seeds is stable across them).
"""

import random
from typing import Callable

__all__ = ["GENERATORS", "VERSIONS", "HELD_OUT", "generate"]

# ---- commopt_tiny ------------------------------------------------------------------------------
_NAMES = ["Mia", "Leo", "Ava", "Noah", "Ivy", "Omar", "Zoe", "Finn", "Lena", "Hugo", "Rosa", "Theo"]
_PRONOUN = {n: ("her" if n in {"Mia", "Ava", "Ivy", "Zoe", "Lena", "Rosa"} else "him") for n in _NAMES}
_SUBJECT = {n: ("She" if _PRONOUN[n] == "her" else "He") for n in _NAMES}
_THINGS = ["apples", "books", "coins", "shells", "stones", "pencils", "cards", "marbles", "plums", "keys"]
_PLACES = ["the market", "the river", "the old mill", "the garden", "the library", "the harbor",
           "the hill", "the bakery", "the forest", "the station"]
_ADJ = ["small", "quiet", "bright", "cold", "warm", "busy", "green", "narrow", "tall", "sunny"]
_WEATHER = ["rain fell softly", "the wind was strong", "the sun was high", "fog covered the road",
            "snow lay on the roofs", "the sky was clear"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve"]


def _story(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    thing = rng.choice(_THINGS)
    place = rng.choice(_PLACES)
    have = rng.randint(1, 9)
    give = rng.randint(1, 3)
    lines = [
        f"One {rng.choice(['morning', 'evening', 'day', 'night'])}, {a} went to {place}.",
        f"The {rng.choice(_ADJ)} streets were {rng.choice(_ADJ)}, and {rng.choice(_WEATHER)}.",
        f"{a} had {have} {thing}.",
    ]
    if rng.random() < 0.5:
        lines.append(f"{b} gave {_PRONOUN[a]} {give} more {thing}.")
        lines.append(f"Now {a} had {have + give} {thing}.")
    else:
        give = min(give, have)
        lines.append(f"{a} gave {b} {give} of the {thing}.")
        lines.append(f"Now {a} had {have - give} {thing}, and {b} had {give}.")
    lines.append(f"{_SUBJECT[a]} counted them: {', '.join(_NUMBER_WORDS[1:min(have, 12) + 1])}.")
    lines.append(f"Then {a} and {b} walked home from {place}.")
    return " ".join(lines)


def tiny(n_docs: int = 4500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_story(rng) for _ in range(rng.randint(1, 3))) for _ in range(n_docs)]


def tiny_heldout(n_docs: int = 500) -> list[str]:
    return _apart(tiny(n_docs * 2, seed=1_000_003), tiny(), n_docs)


# ---- commopt_world -----------------------------------------------------------------------------
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "m", "th"]
_TRADES = ["baker", "smith", "weaver", "potter", "fisher", "miller", "carpenter", "tailor", "mason", "cooper",
           "brewer", "farmer", "shepherd", "healer", "scribe", "glassblower", "tanner", "dyer", "roofer", "cartwright"]
_ANIMALS = ["goat", "dog", "cat", "horse", "donkey", "goose", "hen", "owl", "ferret", "pig", "sheep", "crow"]
_COLOURS = ["red", "blue", "green", "yellow", "grey", "white", "black", "orange", "purple", "brown"]
_GOODS = ["bread", "salt", "wool", "rope", "honey", "candles", "nails", "cheese", "lamp oil", "cloth",
          "apples", "flour", "soap", "ink", "barley", "pottery"]
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_SEASONS = ["spring", "summer", "autumn", "winter"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _unique_words(rng: random.Random, n: int, syllables: tuple[int, int]) -> list[str]:
    seen: set[str] = set()
    out = []
    while len(out) < n:
        w = _word(rng, rng.randint(*syllables)).capitalize()
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


class _World:
    """The fixed facts, drawn once from the seed."""

    def __init__(self, rng: random.Random, people: int = 400, towns: int = 48) -> None:
        self.towns = _unique_words(rng, towns, (2, 3))
        self.people = _unique_words(rng, people, (2, 3))
        self.home = {p: rng.choice(self.towns) for p in self.people}
        self.trade = {p: rng.choice(_TRADES) for p in self.people}
        self.animal = {p: rng.choice(_ANIMALS) for p in self.people}
        self.colour = {p: rng.choice(_COLOURS) for p in self.people}
        self.age = {p: rng.randint(18, 80) for p in self.people}
        self.she = {p: rng.random() < 0.5 for p in self.people}
        # Roads: a ring plus random chords, each of a fixed length in miles.
        self.road: dict[tuple[str, str], int] = {}
        for i, t in enumerate(self.towns):
            self._link(t, self.towns[(i + 1) % towns], rng.randint(3, 40))
        for _ in range(towns):
            a, b = rng.sample(self.towns, 2)
            if (a, b) not in self.road:
                self._link(a, b, rng.randint(3, 40))
        self.neighbours = {t: sorted(b for (a, b) in self.road if a == t) for t in self.towns}
        self.price = {(t, g): rng.randint(1, 12) for t in self.towns for g in _GOODS}
        # Zipf-like popularity: weight 1/(rank + 2).
        self.w_people = [1.0 / (i + 2) for i in range(people)]
        self.w_towns = [1.0 / (i + 2) for i in range(towns)]

    def _link(self, a: str, b: str, miles: int) -> None:
        self.road[(a, b)] = miles
        self.road[(b, a)] = miles

    def person(self, rng: random.Random) -> str:
        return rng.choices(self.people, self.w_people)[0]

    def town(self, rng: random.Random) -> str:
        return rng.choices(self.towns, self.w_towns)[0]


def _subj(w: _World, p: str) -> str:
    return "She" if w.she[p] else "He"


def _obj(w: _World, p: str) -> str:
    return "her" if w.she[p] else "him"


def _poss(w: _World, p: str) -> str:
    return "her" if w.she[p] else "his"


def _fact(w: _World, rng: random.Random, p: str) -> str:
    t, tr, an, co, ag = w.home[p], w.trade[p], w.animal[p], w.colour[p], w.age[p]
    return rng.choice([
        f"{p} is a {tr} from {t}.",
        f"{p}, the {tr}, lives in {t}.",
        f"Everyone in {t} knows {p} the {tr}.",
        f"{p} keeps a {an} and likes the colour {co}.",
        f"{p} of {t} is {ag} years old.",
        f"The {tr} {p} has a {co} door and a {an} in the yard.",
        f"{p} was born in {t} {ag} years ago and works as a {tr}.",
        f"If you need a {tr} in {t}, ask for {p}.",
        f"{_subj(w, p)} who keeps the {an} in {t} is {p}, {ag} years old.",
    ])


def _question(w: _World, rng: random.Random, p: str) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return f"Where does {p} live? {_subj(w, p)} lives in {w.home[p]}."
    if kind == 1:
        return f"What does {p} do? {_subj(w, p)} is a {w.trade[p]}."
    if kind == 2:
        return f"How old is {p}? {_subj(w, p)} is {w.age[p]}."
    return f"Which animal does {p} keep? A {w.animal[p]}."


def _market(w: _World, rng: random.Random, p: str) -> str:
    t = w.home[p] if rng.random() < 0.6 else w.town(rng)
    goods = rng.sample(_GOODS, rng.randint(1, 3))
    money = rng.randint(20, 99)
    parts = [f"On {rng.choice(_WEEKDAYS)} {p} went to the market in {t} with {money} coins."]
    for g in goods:
        n = rng.randint(1, 6)
        cost = n * w.price[(t, g)]
        if cost > money:
            parts.append(f"{_subj(w, p)} wanted {n} of {g}, but that costs {cost} coins and {_subj(w, p).lower()} had only {money}.")
            continue
        money -= cost
        parts.append(f"In {t} {g} costs {w.price[(t, g)]} coins, so {n} of {g} cost {cost} coins; {money} coins were left.")
    parts.append(f"{p} walked home with {money} coins.")
    return " ".join(parts)


def _trip(w: _World, rng: random.Random, p: str) -> str:
    here = w.home[p]
    legs = rng.randint(1, 4)
    total = 0
    parts = [f"In {rng.choice(_SEASONS)} {p} the {w.trade[p]} set out from {here}."]
    for _ in range(legs):
        nxt = rng.choice(w.neighbours[here])
        miles = w.road[(here, nxt)]
        total += miles
        parts.append(rng.choice([
            f"The road from {here} to {nxt} is {miles} miles.",
            f"From {here} {_subj(w, p).lower()} walked {miles} miles to {nxt}.",
            f"{here} and {nxt} lie {miles} miles apart.",
        ]))
        here = nxt
    parts.append(f"So {p} walked {total} miles in all and slept in {here}.")
    return " ".join(parts)


def _meeting(w: _World, rng: random.Random, p: str) -> str:
    q = w.person(rng)
    while q == p:
        q = w.person(rng)
    older, younger = (p, q) if w.age[p] >= w.age[q] else (q, p)
    same = w.home[p] == w.home[q]
    where = f"both live in {w.home[p]}" if same else f"{p} lives in {w.home[p]} and {q} in {w.home[q]}"
    return (
        f"{p} met {q} at the {rng.choice(['well', 'inn', 'mill', 'bridge', 'fair'])}. {where[0].upper() + where[1:]}. "
        f"{older} is {w.age[older] - w.age[younger]} years older than {younger}. "
        f"The {w.trade[p]} asked the {w.trade[q]} about {_poss(w, q)} {w.animal[q]}."
    )


def world(n_docs: int = 80000, seed: int = 0, doc_seed: int | None = None) -> list[str]:
    """``n_docs`` documents of the world drawn from ``seed``; ``doc_seed`` (default ``seed + 1``) seeds
    the stream of documents alone, so another one tells other stories of the same facts. The first
    ``n`` documents do not depend on ``n_docs``."""
    w = _World(random.Random(seed))
    rng = random.Random(seed + 1 if doc_seed is None else doc_seed)
    makers: list[Callable[[_World, random.Random, str], str]] = [_fact, _fact, _question, _market, _trip, _meeting]
    docs = []
    for _ in range(n_docs):
        p = w.person(rng)
        parts = [_fact(w, rng, p)]
        for _ in range(rng.randint(2, 6)):
            parts.append(rng.choice(makers)(w, rng, p if rng.random() < 0.5 else w.person(rng)))
        docs.append(" ".join(parts))
    return docs


def world_heldout(n_docs: int = 2000) -> list[str]:
    return _apart(world(n_docs * 2, doc_seed=1_000_003), world(), n_docs)


def _apart(candidates: list[str], training: list[str], n_docs: int) -> list[str]:
    """The first ``n_docs`` of ``candidates`` that are not documents of ``training``."""
    seen = set(training)
    out = [doc for doc in candidates if doc not in seen][:n_docs]
    if len(out) < n_docs:  # a generator change that made the streams collide: never a short held-out set
        raise RuntimeError(f"only {len(out)} of {n_docs} held-out documents are apart from the training corpus")
    return out


GENERATORS: dict[str, Callable[[], list[str]]] = {
    "commopt_tiny": tiny, "commopt_world": world,
    "commopt_tiny_heldout": tiny_heldout, "commopt_world_heldout": world_heldout,
}
# Bump when a generator's text changes (cache key); a held-out corpus changes with its training corpus.
VERSIONS = {"commopt_tiny": 1, "commopt_world": 2, "commopt_tiny_heldout": 1, "commopt_world_heldout": 1}
HELD_OUT = {"commopt_tiny": "commopt_tiny_heldout", "commopt_world": "commopt_world_heldout"}


def generate(name: str) -> list[str]:
    return GENERATORS[name]()
