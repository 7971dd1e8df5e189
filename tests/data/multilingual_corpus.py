"""A multilingual corpus for the Hugging Face compatibility test, built from Debian packages only:

- real strings: the translations of ISO country, language, currency and script names shipped by
  iso-codes (/usr/share/locale/*/LC_MESSAGES/iso_*.mo), labelled by the script of most of their
  letters (Scripts.txt);
- generated strings: for every script of the Unicode Character Database (unicode-data), words
  drawn from that script's letters, combining marks, digits and punctuation, with spaces, ASCII
  punctuation and digits between them, from a fixed seed.

strings() returns [(script, text)] in a fixed order; the same packages give the same corpus.
"""
import gettext
import glob
import random
import unicodedata

UCD = "/usr/share/unicode"
ISO_DOMAINS = ("iso_3166-1", "iso_639-2", "iso_4217", "iso_15924", "iso_3166-2")


def script_of_code_points(ucd=UCD):
    scripts = {}
    with open(f"{ucd}/Scripts.txt", encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if not line:
                continue
            span, name = (x.strip() for x in line.split(";"))
            lo, _, hi = span.partition("..")
            for cp in range(int(lo, 16), int(hi or lo, 16) + 1):
                scripts[cp] = name
    return scripts


def iso_strings(scripts, per_script):
    """Up to per_script translated names per script, sorted, without duplicates."""
    by_script = {}
    for domain in ISO_DOMAINS:
        for mo in sorted(glob.glob(f"/usr/share/locale/*/LC_MESSAGES/{domain}.mo")):
            with open(mo, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
            for key, text in catalog.items():
                if not key or not isinstance(text, str):
                    continue
                counts = {}
                for ch in text:
                    if ch.isalpha():
                        s = scripts.get(ord(ch), "Unknown")
                        counts[s] = counts.get(s, 0) + 1
                if counts:
                    best = max(sorted(counts), key=lambda s: counts[s])
                    by_script.setdefault(best, set()).add(text)
    out = []
    for script in sorted(by_script):
        texts = sorted(by_script[script])
        step = max(1, len(texts) // per_script)
        out += [(script, t) for t in texts[::step][:per_script]]
    return out


def generated_strings(scripts, per_script, seed=13):
    """per_script strings of pseudo-words for every script with at least 8 letters."""
    members = {}
    for cp, s in scripts.items():
        if s in ("Common", "Inherited", "Unknown"):
            continue
        cat = unicodedata.category(chr(cp))
        if cat[0] in "LMNP":
            members.setdefault(s, {}).setdefault(cat[0], []).append(chr(cp))
    # Inherited marks (U+0300.., U+064B.., zero-width joiners) combine with every script.
    inherited = [chr(cp) for cp, s in scripts.items()
                 if s == "Inherited" and unicodedata.category(chr(cp))[0] == "M"]
    rng = random.Random(seed)
    out = []
    for script in sorted(members):
        parts = members[script]
        letters = parts.get("L", [])
        if len(letters) < 8:
            continue
        marks = parts.get("M", []) or inherited
        digits = parts.get("N", []) + list("0123456789")
        puncts = parts.get("P", []) + list(".,;:!?'\"()-")
        for _ in range(per_script):
            words = []
            for _ in range(rng.randint(1, 6)):
                w = ""
                for _ in range(rng.randint(1, 7)):
                    r = rng.random()
                    w += rng.choice(letters if r < 0.6 else marks if r < 0.8 else
                                    digits if r < 0.9 else puncts)
                words.append(w)
            seps = [" ", " ", " ", "  ", ", ", "\n", "'s ", " 's", "\u00a0", "\u3000", "\t"]
            text = words[0]
            for w in words[1:]:
                text += rng.choice(seps) + w
            out.append((script, text))
    return out


def strings(iso_per_script=300, generated_per_script=30):
    scripts = script_of_code_points()
    return iso_strings(scripts, iso_per_script) + generated_strings(scripts, generated_per_script)
