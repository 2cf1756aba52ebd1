"""The typed bodies of the API's answers, and of the requests no other model types, as pydantic models.

`sits_api.openapi` generates the document's schemas from them, so a client generated from
`GET /openapi.json` reads the answers by these names. Answers may carry fields a model does not name
(a record written by a newer release): every model leaves extra properties allowed.
"""
