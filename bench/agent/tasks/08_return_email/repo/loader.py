import json


def load_user(raw: str) -> dict:
    """Parse a user record, keeping only the public fields."""
    data = json.loads(raw)
    return {"id": data["id"], "name": data["name"]}
