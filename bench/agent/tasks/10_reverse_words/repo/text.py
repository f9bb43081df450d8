def reverse_words(sentence: str) -> str:
    """Reverse the order of the words, keeping each word intact."""
    return sentence[::-1]
