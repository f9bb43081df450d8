from shop.settings import CURRENCY_SYMBOL


def price(amount: float) -> str:
    return f"{amount:.2f} {CURRENCY_SYMBOL}"
