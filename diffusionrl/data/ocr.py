"""Built-in OCR training prompts: varied scenes asking for a short double-quoted text.

Every row is ``{"prompt": 'a chalkboard menu outside a cafe that says "Fresh Soup"', "text": "Fresh Soup"}``.
Texts (1-4 words, at most ``MAX_TEXT_CHARS`` characters, letters/digits/a little punctuation) are
built from this file's own word lists; prompts from its own scene templates. Everything is
deterministic given the seed. Test texts are held out: no test text (compared as the OCR reward
compares them, lowercased without spaces) ever appears in a training row.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MAX_TEXT_CHARS = 20

# ----------------------------------------------------------------------------- word lists

_ADJECTIVES = (
    "fresh hot cold open closed quiet happy lucky golden silver blue green red sunny rainy wild tiny big "
    "best free daily local sweet spicy night early late new old fast slow bright magic royal urban cozy "
    "crisp simple brave gentle lazy proud calm bold"
).split()
_NOUNS = (
    "bread coffee tea soup pizza books garden market bakery diner studio music dream river ocean forest "
    "city road harbor island station cinema library museum shop store club lounge kitchen press games "
    "toys flowers fruit honey candy donuts tacos noodles burgers juice lemonade paint craft records "
    "bikes tools gym park zoo farm hotel motel office lab school"
).split()
_SINGLE_WORDS = (
    "open closed welcome exit entrance stop sale hello goodbye thanks dream believe relax focus smile "
    "coffee bakery pharmacy hotel garage taxi parking library museum cinema theater arcade market diner "
    "pizza tacos sushi bagels donuts juice ramen books music danger caution quiet hope peace love joy "
    "summer winter autumn spring sunrise sunset moonlight thunder ocean forest desert harbor"
).split()
_PHRASES = (
    "keep calm|stay wild|good vibes|no parking|dream big|be kind|go team|happy birthday|well done|"
    "thank you|see you soon|back in five|open late|all you can eat|hot and fresh|made with love|"
    "grand opening|last chance|now hiring|free wifi|please knock|mind the gap|push to open|"
    "no entry|staff only|fresh today|buy one get one|just married|best dad ever|world peace|"
    "hello there|good morning|good night|lets go|try again|you did it|home sweet home|on air|"
    "sold out|coming soon|take a break|think big|stay curious|love wins|game over|level up"
).split("|")
_NUMBER_LABELS = "room gate platform aisle bus route dock lane table track level exit locker unit".split()
_SYLLABLES = (
    "ka lo ve ri zan tor bel mi nu sa qua dex vor lin ta fen gro ly xo pim ro shi ber con dal "
    "mar zo kel vin tra nor pel"
).split()
_BRAND_TAILS = ("", "", "", "ix", "ly", "co", "io", "ex", "a", "o")

# ----------------------------------------------------------------------------- scenes and templates

_SURFACES = (
    "a wooden sign hanging outside a small shop",
    "a neon sign glowing in a dark alley",
    "a hand-painted sign on a brick wall",
    "a street sign on a metal pole",
    "a chalkboard menu outside a cafe",
    "a glass storefront window",
    "a movie poster on a city wall",
    "a concert poster taped to a lamppost",
    "a vintage travel poster",
    "a product label on a glass jar",
    "a label on a wine bottle",
    "a price tag on a shelf",
    "a laptop screen in a dim office",
    "a smartphone screen held in a hand",
    "an old computer terminal screen",
    "a digital billboard above a busy street",
    "a birthday cake with icing",
    "a frosted cupcake",
    "a white T-shirt on a hanger",
    "a black hoodie worn by a person",
    "a coffee mug on a desk",
    "a ceramic mug on a kitchen table",
    "a banner stretched across a street",
    "a banner at a sports stadium",
    "a license plate on a red car",
    "the side of a delivery truck",
    "a handwritten note on a fridge",
    "a sticky note on a monitor",
    "a book cover on a table",
    "a magazine cover on a newsstand",
    "a tote bag on a shoulder",
    "a baseball cap",
    "a doormat in front of a house",
    "a road sign in the desert",
    "a sandcastle flag on the beach",
    "a sign held by a protester",
    "a cardboard sign held by a child",
    "a shop awning",
    "a train station departure board",
    "a wall mural in a city",
    "a greeting card",
    "a cookie with icing letters",
    "a bus destination display",
    "a mailbox",
    "a skateboard deck",
    "a carved stone plaque",
    "a lighthouse painted with letters",
    "a hot air balloon",
)
_STYLES = (
    "", "", "", ", photorealistic", ", studio lighting", ", at sunset", ", watercolor style",
    ", in bold letters", ", close-up photo", ", on a rainy day", ", 35mm film photo", ", minimalist",
)
_TEMPLATES = (
    '{surface} that says "{text}"{style}',
    '{surface} with the text "{text}"{style}',
    '{surface} reading "{text}"{style}',
    '{surface}, the words "{text}" written on it{style}',
    'a photo of {surface} showing "{text}"{style}',
    '{surface} with "{text}" printed in large letters{style}',
)


def _title(words: str) -> str:
    return " ".join(w.capitalize() for w in words.split())


def _brand(rng: random.Random) -> str:
    name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) + rng.choice(_BRAND_TAILS)
    return name.capitalize()


def candidate_texts() -> list[str]:
    """Every text the generator can ask for (fixed order, no two equal after OCR normalisation)."""
    rng = random.Random(20241129)  # fixed: the candidate set must not depend on the user's seed
    texts: list[str] = []
    texts += [w.upper() for w in _SINGLE_WORDS]
    texts += [_title(p) for p in _PHRASES] + [p.upper() for p in _PHRASES[::3]]
    texts += [f"{a} {n}".title() for a in _ADJECTIVES for n in _NOUNS]
    texts += [f"{label.upper()} {rng.randint(1, 999)}" for label in _NUMBER_LABELS for _ in range(12)]
    texts += [f"{n.title()} {rng.choice(('No.', '#'))}{rng.randint(1, 99)}" for n in _NOUNS]
    brands = [_brand(rng) for _ in range(400)]
    texts += brands
    texts += [f"{b} {n.title()}" for b, n in zip(brands, rng.choices(_NOUNS, k=len(brands)))]
    texts += [f"{rng.randint(2, 99)}% OFF" for _ in range(30)] + [f"Since {rng.randint(1900, 2024)}" for _ in range(30)]
    seen: set[str] = set()
    out: list[str] = []
    for text in texts:
        key = "".join(text.split()).lower()
        if key in seen or len(text) > MAX_TEXT_CHARS or not 1 <= len(text.split()) <= 4 or '"' in text:
            continue
        seen.add(key)
        out.append(text)
    return out


def _prompt(rng: random.Random, text: str) -> str:
    template = rng.choice(_TEMPLATES)
    prompt = template.format(surface=rng.choice(_SURFACES), text=text, style=rng.choice(_STYLES))
    return prompt[0].upper() + prompt[1:] if rng.random() < 0.5 else prompt


def _rows(rng: random.Random, texts: list[str], n: int) -> list[dict]:
    order = list(texts)
    rows: list[dict] = []
    while len(rows) < n:  # one pass over the (shuffled) texts before any repeats
        rng.shuffle(order)
        rows += [{"prompt": _prompt(rng, t), "text": t} for t in order[: n - len(rows)]]
    return rows


def generate_ocr_prompts(num_prompts: int, seed: int = 0, test_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """``(train_rows, test_rows)``, ``num_prompts`` in all, ``round(num_prompts * test_fraction)`` for test
    (at least one of each when ``num_prompts >= 2`` and ``test_fraction > 0``).

    Test rows use texts held out from training (the same share of the candidate texts).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction={test_fraction} must be in [0, 1)")
    rng = random.Random(seed)
    texts = candidate_texts()
    rng.shuffle(texts)
    n_test = int(round(num_prompts * test_fraction))
    if test_fraction > 0 and num_prompts >= 2:  # tiny sets: keep one prompt on each side
        n_test = min(max(n_test, 1), num_prompts - 1)
    n_test_texts = max(1, int(round(len(texts) * test_fraction))) if n_test else 0
    test_texts, train_texts = texts[:n_test_texts], texts[n_test_texts:]
    return _rows(rng, train_texts, num_prompts - n_test), _rows(rng, test_texts, n_test)


def write_ocr_jsonl(folder, num_prompts: int, seed: int = 0, test_fraction: float = 0.1) -> tuple[Path, Path]:
    """Write flowgrpo_ocr-style ``train.jsonl`` and ``test.jsonl`` (``{"prompt", "text"}`` a line)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, test = generate_ocr_prompts(num_prompts, seed, test_fraction)
    paths = folder / "train.jsonl", folder / "test.jsonl"
    for path, rows in zip(paths, (train, test)):
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return paths
