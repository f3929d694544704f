"""JSON schemas of the kinds extraction jobs send: nested objects, arrays, enums, numbers,
required and optional fields. Strings and arrays are bounded, as a careful user bounds them:
a small model may otherwise write one string until max_tokens."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: list[tuple[str, dict]] = [
    (
        "Describe a person called Ann Lee, aged 31, living in Paris.",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
            "required": ["name", "age"],
        },
    ),
    (
        "Give the capital city of France and its population in millions.",
        {
            "type": "object",
            "properties": {"city": NAME, "population_millions": {"type": "number"}},
            "required": ["city", "population_millions"],
        },
    ),
    (
        "Classify the sentiment of: 'I love this phone, the battery is great.'",
        {
            "type": "object",
            "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
            "required": ["sentiment"],
        },
    ),
    (
        "List three fruits.",
        {
            "type": "object",
            "properties": {
                "fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}
            },
            "required": ["fruits"],
        },
    ),
    (
        "Give a book with its title, author and year.",
        {
            "type": "object",
            "properties": {
                "title": SHORT,
                "author": NAME,
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
            },
            "required": ["title", "author", "year"],
        },
    ),
    (
        "Describe an address in London with street and postcode.",
        {
            "type": "object",
            "properties": {
                "person": NAME,
                "address": {
                    "type": "object",
                    "properties": {"street": SHORT, "city": NAME, "postcode": NAME},
                    "required": ["street", "city"],
                },
            },
            "required": ["person", "address"],
        },
    ),
    (
        "Is the sky blue? Answer yes or no with a confidence.",
        {
            "type": "object",
            "properties": {
                "answer": {"type": "boolean"},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["answer", "confidence"],
        },
    ),
    (
        "Give two colors with their hex codes.",
        {
            "type": "object",
            "properties": {
                "colors": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": NAME,
                            "hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
                        },
                        "required": ["name", "hex"],
                    },
                    "minItems": 1,
                    "maxItems": 2,
                }
            },
            "required": ["colors"],
        },
    ),
    (
        "Rate this restaurant from 1 to 5 stars: 'Great food, slow service.'",
        {
            "type": "object",
            "properties": {"stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}, "why": SHORT},
            "required": ["stars"],
        },
    ),
    (
        "Extract the date: 'The meeting is on 12 March 2024.'",
        {
            "type": "object",
            "properties": {
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
                "month": {
                    "enum": [
                        "January",
                        "February",
                        "March",
                        "April",
                        "May",
                        "June",
                        "July",
                        "August",
                        "September",
                        "October",
                        "November",
                        "December",
                    ]
                },
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            },
            "required": ["day", "month", "year"],
        },
    ),
    (
        "Give a product with a price and a currency.",
        {
            "type": "object",
            "properties": {
                "product": NAME,
                "price": {"type": "number", "minimum": 0},
                "currency": {"enum": ["USD", "EUR", "GBP"]},
            },
            "required": ["product", "price", "currency"],
        },
    ),
    (
        "Give the coordinates of a point.",
        {
            "type": "object",
            "properties": {
                "point": {
                    "type": "array",
                    "items": {"type": "number"},
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["point"],
        },
    ),
    (
        "Describe a company with its employees.",
        {
            "type": "object",
            "properties": {
                "company": NAME,
                "employees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": NAME,
                            "role": {"enum": ["engineer", "manager", "designer"]},
                        },
                        "required": ["name", "role"],
                    },
                    "maxItems": 3,
                },
            },
            "required": ["company", "employees"],
        },
    ),
    (
        "Translate 'hello' to Spanish.",
        {
            "type": "object",
            "properties": {"source": NAME, "target": NAME, "language": NAME},
            "required": ["source", "target"],
        },
    ),
    (
        "Give a weather report for Tokyo.",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "wind": {
                    "type": "object",
                    "properties": {
                        "speed_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
                        "direction": {"enum": ["N", "E", "S", "W"]},
                    },
                    "required": ["speed_kmh", "direction"],
                },
            },
            "required": ["city", "temperature_c", "conditions", "wind"],
        },
    ),
    (
        "List two tags for a blog post about cooking pasta.",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["food", "italian", "recipe", "travel", "tech"]},
                    "minItems": 1,
                    "maxItems": 2,
                }
            },
            "required": ["tags"],
        },
    ),
    (
        "Give a user profile with an optional nickname.",
        {
            "type": "object",
            "properties": {
                "username": NAME,
                "nickname": NAME,
                "verified": {"type": "boolean"},
            },
            "required": ["username", "verified"],
        },
    ),
    (
        "Give a math problem and its answer.",
        {
            "type": "object",
            "properties": {"question": SHORT, "answer": {"type": "integer"}},
            "required": ["question", "answer"],
        },
    ),
    (
        "Give a matrix of two rows of two integers.",
        {
            "type": "object",
            "properties": {
                "rows": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": -99, "maximum": 99},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["rows"],
        },
    ),
    (
        "Describe a movie: title, genre and rating.",
        {
            "type": "object",
            "properties": {
                "title": SHORT,
                "genre": {"enum": ["drama", "comedy", "action", "horror", "documentary"]},
                "rating": {"type": "number", "minimum": 0, "maximum": 10},
            },
            "required": ["title", "genre", "rating"],
        },
    ),
    (
        "Give an order with items and quantities.",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": NAME,
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        },
                        "required": ["sku", "qty"],
                    },
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["order_id", "items"],
        },
    ),
    (
        "Give the status of a job.",
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["queued", "running", "done", "failed"]},
                "progress": {"type": "integer", "minimum": 0, "maximum": 100},
                "error": {"anyOf": [NAME, {"type": "null"}]},
            },
            "required": ["status", "progress", "error"],
        },
    ),
    (
        "Give a nested tree: a root with up to two children, each with a name.",
        {
            "type": "object",
            "properties": {
                "root": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "children": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {"name": NAME},
                                "required": ["name"],
                            },
                            "maxItems": 2,
                        },
                    },
                    "required": ["name", "children"],
                }
            },
            "required": ["root"],
        },
    ),
    (
        "Give a recipe name and a list of up to three ingredients with amounts in grams.",
        {
            "type": "object",
            "properties": {
                "recipe": NAME,
                "ingredients": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": NAME,
                            "grams": {"type": "integer", "minimum": 1, "maximum": 5000},
                        },
                        "required": ["name", "grams"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["recipe", "ingredients"],
        },
    ),
]
