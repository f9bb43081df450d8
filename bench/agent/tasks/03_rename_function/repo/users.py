USERS = {1: "ada", 2: "grace"}


def get_usr(user_id: int) -> str | None:
    """Look a user name up by id."""
    return USERS.get(user_id)
