"""The stateless router: authenticate → validate → tokenize → hash → route → relay."""
