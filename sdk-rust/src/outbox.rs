//! Transactional enqueue: a task inserted into the application's own PostgreSQL transaction
//! (the table `cronoq_outbox` that `cronoq outbox install` creates); a cronoq-server relay
//! submits it once the transaction commits, and never when it rolls back.
//!
//! ```no_run
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use cronoq::TaskSpec;
//!
//! let tx = client.transaction().await?;
//! tx.execute("UPDATE orders SET state = 'paid' WHERE id = $1", &[&42i64]).await?;
//! let id = cronoq::outbox::enqueue(&tx, TaskSpec::new("emails").json(&42)?.key("receipt-42")).await?;
//! tx.commit().await?; // the task exists once this commits (its outbox row is `id`)
//! # let _ = id;
//! # Ok(())
//! # }
//! ```
//!
//! With sqlx (feature `outbox-sqlx`): `cronoq::outbox::enqueue(&mut tx, spec)` with a
//! `sqlx::Transaction<'_, Postgres>`.

use std::future::Future;

use prost::Message;

use crate::checks::check_submit;
use crate::client::TaskSpec;

/// The schema `cronoq outbox install` creates the table in when given none.
pub const DEFAULT_SCHEMA: &str = "cronoq";
/// The largest payload the server takes by default (its `limits.max_payload_bytes`).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1 << 20;
/// The longest schema name PostgreSQL keeps (NAMEDATALEN - 1).
const MAX_SCHEMA_CHARS: usize = 63;

/// Why an enqueue failed; the transaction is the caller's to roll back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A task or an option the server would refuse (code INVALID_ARGUMENT): the message names
    /// the field and the value; nothing was inserted.
    #[error(transparent)]
    Invalid(#[from] crate::Error),
    /// tokio-postgres failed the insert (no outbox table in that schema, a broken connection...).
    #[cfg(feature = "outbox")]
    #[error("inserting into the outbox: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// sqlx failed the insert.
    #[cfg(feature = "outbox-sqlx")]
    #[error("inserting into the outbox: {0}")]
    Sqlx(#[from] sqlx::Error),
}

/// A transaction to insert into: `&tokio_postgres::Transaction` (feature `outbox`) or
/// `&mut sqlx::Transaction<'_, Postgres>` (feature `outbox-sqlx`).
pub trait OutboxTransaction: sealed::Sealed {
    #[doc(hidden)]
    fn insert_rows(
        self,
        sql: String,
        pools: Vec<String>,
        requests: Vec<Vec<u8>>,
    ) -> impl Future<Output = Result<Vec<i64>, Error>> + Send;
}

mod sealed {
    pub trait Sealed {}
}

/// Where and how tasks are enqueued: the table's schema and the payload bound.
#[derive(Debug, Clone)]
pub struct Outbox {
    schema: String,
    max_payload_bytes: usize,
}

impl Default for Outbox {
    fn default() -> Outbox {
        Outbox {
            schema: DEFAULT_SCHEMA.to_string(),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

impl Outbox {
    /// The table in schema "cronoq", payloads up to 1 MiB.
    pub fn new() -> Outbox {
        Outbox::default()
    }

    /// The schema the table was installed in (`cronoq outbox install --schema`): letters,
    /// digits and `_`, not starting with a digit, at most 63 (checked at enqueue).
    pub fn schema(mut self, schema: impl Into<String>) -> Outbox {
        self.schema = schema.into();
        self
    }

    /// The server's `limits.max_payload_bytes`, when it was raised above the default 1 MiB.
    pub fn max_payload_bytes(mut self, max_payload_bytes: usize) -> Outbox {
        self.max_payload_bytes = max_payload_bytes;
        self
    }

    /// Inserts one task into the transaction's outbox table; its row id. A task the server
    /// would refuse fails here, before anything is inserted.
    pub async fn enqueue<T: OutboxTransaction>(&self, tx: T, spec: TaskSpec) -> Result<i64, Error> {
        let ids = self.insert(tx, std::slice::from_ref(&spec), "").await?;
        Ok(ids[0])
    }

    /// Inserts the tasks in one statement; their row ids, in the order given (the order the
    /// relay submits them in). One the server would refuse fails them all, before any insert.
    pub async fn enqueue_many<T: OutboxTransaction>(
        &self,
        tx: T,
        specs: &[TaskSpec],
    ) -> Result<Vec<i64>, Error> {
        if specs.is_empty() {
            return Ok(Vec::new());
        }
        self.insert(tx, specs, "tasks").await
    }

    async fn insert<T: OutboxTransaction>(
        &self,
        tx: T,
        specs: &[TaskSpec],
        field: &str,
    ) -> Result<Vec<i64>, Error> {
        let table = self.table()?;
        let mut pools = Vec::with_capacity(specs.len());
        let mut requests = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            // request_id stays empty: the relay sets its own, so a relayed row is submitted once.
            let request = spec.proto();
            let at = if field.is_empty() {
                String::new()
            } else {
                format!("{field}[{i}].")
            };
            check_submit(&request, &at, self.max_payload_bytes)?;
            pools.push(request.pool.clone());
            requests.push(request.encode_to_vec());
        }
        let sql = format!(
            "INSERT INTO {table} (pool, request) \
             SELECT pool, request FROM unnest($1::text[], $2::bytea[]) WITH ORDINALITY AS t(pool, request, n) \
             ORDER BY n RETURNING id"
        );
        let mut ids = tx.insert_rows(sql, pools, requests).await?;
        // Identities are drawn in the ORDER BY order: ascending ids are the tasks' order.
        ids.sort_unstable();
        Ok(ids)
    }

    fn table(&self) -> Result<String, crate::Error> {
        let schema = &self.schema;
        let mut chars = schema.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !(first_ok && rest_ok && schema.len() <= MAX_SCHEMA_CHARS) {
            return Err(crate::Error::InvalidArgument(format!(
                "schema: {schema:?} is not a plain identifier (letters, digits and _, not starting with a digit, at most {MAX_SCHEMA_CHARS})"
            )));
        }
        Ok(format!("\"{schema}\".cronoq_outbox"))
    }
}

/// Inserts one task into the outbox table of schema "cronoq" in `tx`; its row id. See
/// [`Outbox::enqueue`].
pub async fn enqueue<T: OutboxTransaction>(tx: T, spec: TaskSpec) -> Result<i64, Error> {
    Outbox::default().enqueue(tx, spec).await
}

/// Inserts the tasks into the outbox table of schema "cronoq" in `tx`, in one statement; their
/// row ids in order. See [`Outbox::enqueue_many`].
pub async fn enqueue_many<T: OutboxTransaction>(
    tx: T,
    specs: &[TaskSpec],
) -> Result<Vec<i64>, Error> {
    Outbox::default().enqueue_many(tx, specs).await
}

#[cfg(feature = "outbox")]
impl sealed::Sealed for &tokio_postgres::Transaction<'_> {}

#[cfg(feature = "outbox")]
impl OutboxTransaction for &tokio_postgres::Transaction<'_> {
    async fn insert_rows(
        self,
        sql: String,
        pools: Vec<String>,
        requests: Vec<Vec<u8>>,
    ) -> Result<Vec<i64>, Error> {
        let rows = self.query(sql.as_str(), &[&pools, &requests]).await?;
        Ok(rows.iter().map(|row| row.get::<_, i64>(0)).collect())
    }
}

#[cfg(feature = "outbox-sqlx")]
impl sealed::Sealed for &mut sqlx::Transaction<'_, sqlx::Postgres> {}

#[cfg(feature = "outbox-sqlx")]
impl OutboxTransaction for &mut sqlx::Transaction<'_, sqlx::Postgres> {
    async fn insert_rows(
        self,
        sql: String,
        pools: Vec<String>,
        requests: Vec<Vec<u8>>,
    ) -> Result<Vec<i64>, Error> {
        let ids = sqlx::query_scalar::<_, i64>(sql.as_str())
            .bind(pools)
            .bind(requests)
            .fetch_all(&mut **self)
            .await?;
        Ok(ids)
    }
}
