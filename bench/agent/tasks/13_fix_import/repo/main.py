from utils import slugify

if __name__ == "__main__":
    print(slugify("Hello, World!"))
