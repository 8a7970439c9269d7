-- Maintenance leases: each role (today "maintenance:<namespace>:<topic>") is
-- held by one dispatcher at a time, which sweeps exhausted events, purges
-- delivered ones and reads the gauges of that topic. A holder renews its
-- lease well before it expires; another dispatcher takes the role only once
-- the lease has expired (its holder died or lost the database).
CREATE TABLE modkit_outbox_leaders (
    role       text        PRIMARY KEY,
    holder     uuid        NOT NULL,
    expires_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
