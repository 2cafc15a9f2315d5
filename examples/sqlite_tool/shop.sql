-- A tiny shop: four customers and their orders. The example database of the sqlite tool plug-in,
-- built (never committed as a binary) with:
--   python -m vcpo_sqlite_tool.make_database examples/sqlite_tool/shop.sql examples/sqlite_tool/shop.sqlite
CREATE TABLE customers (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    city TEXT NOT NULL
);

CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers (id),
    item TEXT NOT NULL,
    quantity INTEGER NOT NULL,
    price REAL NOT NULL  -- euros per item
);

INSERT INTO customers (id, name, city) VALUES
    (1, 'Ada', 'London'),
    (2, 'Grace', 'New York'),
    (3, 'Alan', 'Manchester'),
    (4, 'Katherine', 'Hampton');

INSERT INTO orders (id, customer_id, item, quantity, price) VALUES
    (1, 1, 'notebook', 2, 3.5),
    (2, 2, 'pen', 10, 1.2),
    (3, 1, 'pen', 5, 1.2),
    (4, 3, 'lamp', 1, 24.0),
    (5, 2, 'notebook', 3, 3.5),
    (6, 1, 'lamp', 1, 24.0),
    (7, 3, 'pen', 2, 1.2);
