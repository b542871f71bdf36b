def count_words(text):
    """How many words ``text`` holds."""
    return len(text.split(" "))
