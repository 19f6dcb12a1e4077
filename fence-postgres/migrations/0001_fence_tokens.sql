-- The fence table used by fence-postgres (PgFence::migrate runs the same statement).
-- One row per protected resource: the newest accepted token, and the last value written
-- through the fence with the token that wrote it.
CREATE TABLE IF NOT EXISTS fence_tokens (
    resource     TEXT        PRIMARY KEY,
    newest       BIGINT      NOT NULL CHECK (newest >= 0),
    value        BYTEA,
    value_token  BIGINT,
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
