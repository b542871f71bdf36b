#!/bin/bash
cat > /app/wordcount.py <<'PY'
def count_words(text):
    """How many words ``text`` holds."""
    return len(text.split())
PY
