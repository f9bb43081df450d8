from shop.format import price


def test_price():
    assert price(3.5) == "3.50 €"
