def greet(name: str) -> str:
    return f"Helo, {name}!"
