package io.rollstream;

import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.PrintStream;
import java.io.Reader;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashSet;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.TreeMap;
import java.util.function.Function;
import java.util.stream.Collectors;
import org.apache.avro.AvroRuntimeException;
import org.apache.avro.Schema;
import org.apache.avro.SchemaCompatibility;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * Reads rollstream's scored groups (NS.rollouts) outside Python and prints one JSON line per group.
 *
 * <p>The wire format is Avro single-object encoding (docs/wire-format.md): {@code C3 01}, the 8-byte
 * little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form, the Avro binary body.
 * The schemas are the {@code .avsc} files the Python package ships (schemas/avro and schemas/avro/history),
 * read from {@code --schema-dir} or, in the jar {@code mvn package} builds, from the classpath
 * ({@code io/rollstream/avro/}). A record of an older schema is resolved to the current one by Avro (the
 * fields it lacks take their defaults); a record whose fingerprint no schema has, of another record type,
 * or of a version Avro resolution cannot bring to the current one, is an error that names it.
 *
 * <p>The packed columns are unpacked as the schema's docs say: little-endian int32 token ids and lengths,
 * float32 logprobs, float64 rewards (NaN: none), int64 versions, one byte per finish reason, flag and
 * loss-mask entry; response texts are split by their lengths in Unicode code points (not UTF-16 chars).
 *
 * <p>Run with Java's single-file source launcher (no build):
 * {@code java -cp 'LIBS/*' schemas/java/src/main/java/io/rollstream/GroupReader.java --schema-dir
 * schemas/avro --bootstrap-servers HOST:PORT --topic NS.rollouts}. Exit status: 0 read everything asked
 * for; 1 usage, I/O, Kafka or timeout; 2 a record it cannot decode (the message names it).
 */
public final class GroupReader {

    /** Every record type's current schema file; older versions are {@code history/NAME.vN.avsc}, N = 1, 2, ... */
    static final List<String> RECORD_FILES =
            List.of("scored_group", "prompt", "step_manifest", "policy_version", "trainer_position",
                    "inflight_checkpoint");
    static final List<String> FINISH_REASONS = List.of("stop", "length", "abort");  // schemas/records.py
    static final String SCORED_GROUP = "rollstream.ScoredGroup";
    static final String CLASSPATH_DIR = "io/rollstream/avro/";

    private GroupReader() {}

    public static void main(String[] args) {
        // Kafka's client logs its whole configuration at INFO; keep warnings and errors (on stderr).
        System.setProperty("org.slf4j.simpleLogger.defaultLogLevel",
                System.getProperty("org.slf4j.simpleLogger.defaultLogLevel", "warn"));
        int status;
        // UTF-8 whatever the platform's charset (Java 17 writes System.out in the locale's, maybe ASCII).
        PrintStream out = new PrintStream(new FileOutputStream(FileDescriptor.out), false, StandardCharsets.UTF_8);
        try {
            status = run(Options.parse(args), out);
        } catch (ReaderException e) {
            System.err.println("GroupReader: " + e.getMessage());
            status = e.status;
        }
        out.flush();
        System.exit(status);
    }

    static int run(Options options, PrintStream out) {
        Decoder decoder = new Decoder(options.schemaDir == null ? classpathSchemas() : directorySchemas(options.schemaDir));
        if (options.fingerprints) {
            decoder.fingerprints().forEach((hex, file) -> out.println(hex + " " + file));
            return 0;
        }
        int printed = 0;
        for (Path file : options.files) {
            if (printed >= options.max) {
                break;
            }
            byte[] value = readFile(file);
            out.println(Json.of(decoder.decodeAt(value, file.toString()).toMap(options.tokens)));
            printed++;
        }
        if (options.topic != null) {
            readTopic(options, decoder, out, options.max - printed);
        }
        return 0;
    }

    // ------------------------------------------------------------------ schemas

    /** A schema records may be written with: its file, the schema, and why Avro cannot resolve it (or null). */
    record Writer(String file, Schema schema, String unresolvable) {}

    /** The schema files under {@code dir} (schemas/avro of a rollstream checkout). */
    static Schemas directorySchemas(Path dir) {
        return new Schemas(dir.toString(), name -> {
            Path path = dir.resolve(name);
            try {
                return Files.exists(path) ? Files.newInputStream(path) : null;
            } catch (IOException e) {
                throw new ReaderException(1, "cannot read " + path + ": " + e.getMessage());
            }
        });
    }

    /** The schema files the jar carries (mvn package puts schemas/avro there). */
    static Schemas classpathSchemas() {
        return new Schemas("the classpath (" + CLASSPATH_DIR + ")",
                name -> GroupReader.class.getClassLoader().getResourceAsStream(CLASSPATH_DIR + name));
    }

    /** Where schema files come from: {@code open} gives a file's stream by its relative name, or null. */
    record Schemas(String where, Function<String, InputStream> open) {

        /** Every schema file present: NAME.avsc, then history/NAME.v1.avsc, v2, ... up to the first missing. */
        Map<String, Schema> load() {
            Map<String, Schema> out = new LinkedHashMap<>();
            for (String name : RECORD_FILES) {
                parse(name + ".avsc", out);
                for (int v = 1; parse("history/" + name + ".v" + v + ".avsc", out); v++) {
                    // each older version in turn
                }
            }
            if (!out.containsKey("scored_group.avsc")) {
                throw new ReaderException(1, "no scored_group.avsc in " + where
                        + "; pass --schema-dir PATH (the schemas/avro directory of rollstream)");
            }
            return out;
        }

        private boolean parse(String name, Map<String, Schema> out) {
            try (InputStream in = open.apply(name)) {
                if (in == null) {
                    return false;
                }
                out.put(name, new Schema.Parser().parse(in));  // a fresh parser: every version names rollstream.*
                return true;
            } catch (IOException | AvroRuntimeException e) {
                throw new ReaderException(1, "cannot parse " + name + " in " + where + ": " + e.getMessage());
            }
        }
    }

    /** The 8 bytes single-object encoding writes for {@code schema}, as hex (what Python's codec.fingerprints() says). */
    static String fingerprintHex(Schema schema) {
        long fingerprint = SchemaNormalization.parsingFingerprint64(schema);
        return HexFormat.of().formatHex(ByteBuffer.allocate(8).order(ByteOrder.LITTLE_ENDIAN).putLong(fingerprint).array());
    }

    // ------------------------------------------------------------------ decoding

    /** Decodes single-object ScoredGroup records of any known writer schema. Not thread-safe (Avro's decoder is not). */
    static final class Decoder {
        private final Map<Long, Writer> writers = new LinkedHashMap<>();
        private final BinaryMessageDecoder<GenericRecord> avro;

        Decoder(Schemas source) {
            Map<String, Schema> files = source.load();
            Schema current = files.get("scored_group.avsc");
            avro = new BinaryMessageDecoder<>(GenericData.get(), current);
            files.forEach((file, schema) -> {
                String unresolvable = null;
                if (schema.getFullName().equals(SCORED_GROUP) && schema != current) {
                    SchemaCompatibility.SchemaPairCompatibility check =
                            SchemaCompatibility.checkReaderWriterCompatibility(current, schema);
                    if (check.getType() == SchemaCompatibility.SchemaCompatibilityType.COMPATIBLE) {
                        avro.addSchema(schema);  // resolved to the current schema; missing fields take defaults
                    } else {
                        unresolvable = check.getResult().getIncompatibilities().stream()
                                .collect(Collectors.groupingBy(i -> i.getType().toString().toLowerCase().replace('_', ' '),
                                        LinkedHashMap::new, Collectors.mapping(i -> i.getMessage(), Collectors.joining(", "))))
                                .entrySet().stream().map(e -> e.getKey() + ": " + e.getValue())
                                .collect(Collectors.joining("; "));
                    }
                }
                writers.putIfAbsent(SchemaNormalization.parsingFingerprint64(schema), new Writer(file, schema, unresolvable));
            });
        }

        /** Every known fingerprint (hex, as on the wire) and its schema file, sorted by fingerprint. */
        Map<String, String> fingerprints() {
            Map<String, String> out = new TreeMap<>();
            writers.values().forEach(w -> out.put(fingerprintHex(w.schema()), w.file()));
            return out;
        }

        /** {@link #decode}, with {@code where} (a topic position or a file) in the message of a ReaderException. */
        Group decodeAt(byte[] value, String where) {
            try {
                return decode(value);
            } catch (ReaderException e) {
                throw new ReaderException(e.status, where + ": " + e.getMessage());
            }
        }

        /** The group in {@code value}. Raises ReaderException (status 2) when it is not a ScoredGroup this reader knows. */
        Group decode(byte[] value) {
            Writer writer = writerOf(value);
            if (!writer.schema().getFullName().equals(SCORED_GROUP)) {
                throw new ReaderException(2, "a " + writer.schema().getName() + " record (" + writer.file()
                        + "), not a ScoredGroup: is this NS.rollouts?");
            }
            if (writer.unresolvable() != null) {
                throw new ReaderException(2, "written with " + writer.file() + ", which Avro schema resolution cannot "
                        + "bring to scored_group.avsc (" + writer.unresolvable() + "); rollstream's Python codec "
                        + "upgrades it (schemas/_upgrade.py, docs/wire-format.md)");
            }
            GenericRecord record;
            try {
                record = avro.decode(value);
            } catch (IOException | AvroRuntimeException e) {
                throw new ReaderException(2, "corrupt ScoredGroup (" + writer.file() + "): " + e);
            }
            try {
                return Group.of(record, writer.file());
            } catch (IndexOutOfBoundsException | IllegalArgumentException e) {
                throw new ReaderException(2, "corrupt ScoredGroup (" + writer.file() + "): " + e.getMessage());
            }
        }

        private Writer writerOf(byte[] value) {
            if (value == null || value.length < 10 || value[0] != (byte) 0xC3 || value[1] != (byte) 0x01) {
                String head = value == null ? "no value" : HexFormat.of().formatHex(value, 0, Math.min(10, value.length));
                throw new ReaderException(2, "not a rollstream record: expected the Avro single-object marker c301, got "
                        + (head.isEmpty() ? "no bytes" : head));
            }
            long fingerprint = ByteBuffer.wrap(value, 2, 8).order(ByteOrder.LITTLE_ENDIAN).getLong();
            Writer writer = writers.get(fingerprint);
            if (writer == null) {
                throw new ReaderException(2, "unknown schema fingerprint " + HexFormat.of().formatHex(value, 2, 10)
                        + ": written by a newer or foreign producer? Pass --schema-dir with the schemas/avro of the "
                        + "rollstream that wrote it, or check what writes to this topic");
            }
            return writer;
        }
    }

    /** The sampling parameters that shaped the logprobs (top_k -1: off). */
    record Sampling(double temperature, double topP, int topK) {}

    /**
     * One response of a group, unpacked from the columns. logprobs, lossMask: null when the sample has none;
     * resumePoints: the token indices where its generation resumed from an in-flight checkpoint of the producer
     * resumedFrom names (both empty when it never resumed).
     */
    record Sample(int[] tokens, float[] logprobs, String text, Double reward, String finishReason,
                  long[] weightVersions, byte[] lossMask, long[][] versionSpans, int[] resumePoints,
                  String[] resumedFrom) {

        Map<String, Object> toMap(boolean withTokens) {
            Map<String, Object> out = new LinkedHashMap<>();
            out.put("n_tokens", tokens.length);
            out.put("reward", reward);
            out.put("finish_reason", finishReason);
            out.put("text", text);
            out.put("weight_versions", weightVersions);
            out.put("has_logprobs", logprobs != null);
            out.put("resume_points", resumePoints);
            out.put("resumed_from", resumedFrom);
            if (withTokens) {
                out.put("tokens", tokens);
                out.put("logprobs", logprobs);
                out.put("loss_mask", lossMask);
                out.put("version_spans", versionSpans);
            }
            return out;
        }
    }

    /** A scored group: what one prompt's generation produced in one epoch (status "ok" or "failed"). */
    record Group(String groupId, String promptId, int epoch, String status, String error, String producerId,
                 long startedAtMs, long finishedAtMs, String prompt, Map<String, String> metadata, Sampling sampling,
                 int attempt, int maxAttempts, boolean retriable, byte[] sourcePrompt, long policyRun, int[] promptTokens,
                 List<Sample> samples, String writerFile) {

        static Group of(GenericRecord r, String writerFile) {
            GenericRecord s = (GenericRecord) r.get("sampling");
            Sampling sampling = s == null ? null
                    : new Sampling((Double) s.get("temperature"), (Double) s.get("top_p"), (Integer) s.get("top_k"));
            Map<String, String> metadata = new TreeMap<>();
            ((Map<?, ?>) r.get("metadata")).forEach((k, v) -> metadata.put(k.toString(), v.toString()));
            return new Group(str(r, "group_id"), str(r, "prompt_id"), (Integer) r.get("epoch"),
                    r.get("status").toString().toLowerCase(), r.get("error") == null ? null : str(r, "error"),
                    str(r, "producer_id"), (Long) r.get("started_at_ms"), (Long) r.get("finished_at_ms"),
                    str(r, "prompt"), metadata, sampling, (Integer) r.get("attempt"), (Integer) r.get("max_attempts"),
                    (Boolean) r.get("retriable"), bytes(r, "source_prompt"), (Long) r.get("policy_run"),
                    ints(r, "prompt_tokens"), samples(r),
                    writerFile);
        }

        /** The samples of a v7 record, split out of its columns (each packed one entry per sample, in order). */
        static List<Sample> samples(GenericRecord r) {
            int[] lengths = ints(r, "response_lengths");
            double[] rewards = doubles(r, "rewards");
            byte[] finish = bytes(r, "finish_reasons");
            byte[] hasLogprobs = bytes(r, "has_logprobs");
            int[] versionCounts = ints(r, "weight_version_counts");
            long[] versions = longs(r, "weight_versions");
            byte[] hasMask = bytes(r, "has_loss_mask");
            int[] spanCounts = ints(r, "version_span_counts");
            long[] spans = longs(r, "version_spans");
            int[] textLengths = ints(r, "text_lengths");
            String texts = str(r, "texts");
            int[] tokens = ints(r, "tokens");
            float[] logprobs = floats(r, "logprobs");
            byte[] masks = bytes(r, "loss_masks");
            int[] resumeCounts = ints(r, "resume_point_counts");  // empty when no sample resumed (most groups)
            int[] resumePoints = ints(r, "resume_points");
            int[] producerLengths = ints(r, "resumed_from_lengths");
            String producers = str(r, "resumed_from");
            int n = lengths.length;
            if (resumeCounts.length != 0 && resumeCounts.length != n || producerLengths.length != resumePoints.length) {
                throw new IllegalArgumentException("resume columns disagree: " + resumeCounts.length + " counts for " + n
                        + " samples, " + resumePoints.length + " resume points, " + producerLengths.length + " producer ids");
            }
            for (int count : new int[] {rewards.length, finish.length, hasLogprobs.length, versionCounts.length,
                    hasMask.length, spanCounts.length, textLengths.length}) {
                if (count != n) {
                    throw new IllegalArgumentException("columns disagree on the number of samples (" + n + " lengths)");
                }
            }
            List<Sample> out = new ArrayList<>(n);
            int tokenAt = 0, logprobAt = 0, maskAt = 0, versionAt = 0, spanAt = 0, charAt = 0, resumeAt = 0, producerAt = 0;
            for (int i = 0; i < n; i++) {
                int len = lengths[i];
                float[] lp = hasLogprobs[i] == 1 ? Arrays.copyOfRange(logprobs, logprobAt, logprobAt += len) : null;
                byte[] mask = hasMask[i] == 1 ? Arrays.copyOfRange(masks, maskAt, maskAt += len) : null;
                long[][] own = new long[spanCounts[i]][];
                for (int k = 0; k < own.length; k++, spanAt += 3) {
                    own[k] = Arrays.copyOfRange(spans, spanAt, spanAt + 3);  // version, start, end
                }
                int textEnd = texts.offsetByCodePoints(charAt, textLengths[i]);  // lengths count code points
                int resumeCount = resumeCounts.length == 0 ? 0 : resumeCounts[i];
                int[] resumes = Arrays.copyOfRange(resumePoints, resumeAt, resumeAt + resumeCount);
                String[] from = new String[resumes.length];
                for (int k = 0; k < from.length; k++) {
                    int end = producers.offsetByCodePoints(producerAt, producerLengths[resumeAt + k]);
                    from[k] = producers.substring(producerAt, end);
                    producerAt = end;
                }
                resumeAt += resumes.length;
                out.add(new Sample(Arrays.copyOfRange(tokens, tokenAt, tokenAt += len), lp, texts.substring(charAt, textEnd),
                        Double.isNaN(rewards[i]) ? null : rewards[i], FINISH_REASONS.get(finish[i]),
                        Arrays.copyOfRange(versions, versionAt, versionAt += versionCounts[i]), mask, own, resumes, from));
                charAt = textEnd;
            }
            if (tokenAt != tokens.length || logprobAt != logprobs.length || maskAt != masks.length
                    || versionAt != versions.length || spanAt != spans.length || charAt != texts.length()
                    || resumeAt != resumePoints.length || producerAt != producers.length()) {
                throw new IllegalArgumentException("the packed columns hold more than the samples' lengths say");
            }
            return out;
        }

        Map<String, Object> toMap(boolean withTokens) {
            Map<String, Object> out = new LinkedHashMap<>();
            out.put("group_id", groupId);
            out.put("prompt_id", promptId);
            out.put("epoch", epoch);
            out.put("status", status);
            out.put("error", error);
            out.put("attempt", attempt);
            out.put("max_attempts", maxAttempts);
            out.put("retriable", retriable);
            out.put("policy_run", policyRun);
            out.put("producer_id", producerId);
            out.put("prompt", prompt);
            out.put("metadata", metadata);
            Map<String, Object> shaped = new LinkedHashMap<>();
            if (sampling != null) {
                shaped.put("temperature", sampling.temperature());
                shaped.put("top_p", sampling.topP());
                shaped.put("top_k", sampling.topK());
            }
            out.put("sampling", sampling == null ? null : shaped);
            out.put("n_prompt_tokens", promptTokens.length);
            out.put("rewards", samples.stream().map(Sample::reward).collect(Collectors.toList()));
            out.put("token_counts", samples.stream().map(x -> x.tokens().length).collect(Collectors.toList()));
            out.put("samples", samples.stream().map(x -> x.toMap(withTokens)).collect(Collectors.toList()));
            if (withTokens) {
                out.put("prompt_tokens", promptTokens);
            }
            out.put("schema", writerFile);
            return out;
        }
    }

    private static String str(GenericRecord r, String field) {
        return r.get(field).toString();  // Avro strings decode as Utf8
    }

    /** A packed bytes field, positioned at its first byte, little-endian. */
    private static ByteBuffer packed(GenericRecord r, String field, int itemSize) {
        ByteBuffer buffer = ((ByteBuffer) r.get(field)).duplicate().order(ByteOrder.LITTLE_ENDIAN);
        if (buffer.remaining() % itemSize != 0) {
            throw new IllegalArgumentException("field " + field + ": " + buffer.remaining()
                    + " bytes is not a multiple of " + itemSize);
        }
        return buffer;
    }

    private static byte[] bytes(GenericRecord r, String field) {
        ByteBuffer b = packed(r, field, 1);
        byte[] out = new byte[b.remaining()];
        b.get(out);
        return out;
    }

    private static int[] ints(GenericRecord r, String field) {
        ByteBuffer b = packed(r, field, 4);
        int[] out = new int[b.remaining() / 4];
        b.asIntBuffer().get(out);  // a view keeps the buffer's (little-endian) order
        return out;
    }

    private static long[] longs(GenericRecord r, String field) {
        ByteBuffer b = packed(r, field, 8);
        long[] out = new long[b.remaining() / 8];
        b.asLongBuffer().get(out);
        return out;
    }

    private static float[] floats(GenericRecord r, String field) {
        ByteBuffer b = packed(r, field, 4);
        float[] out = new float[b.remaining() / 4];
        b.asFloatBuffer().get(out);
        return out;
    }

    private static double[] doubles(GenericRecord r, String field) {
        ByteBuffer b = packed(r, field, 8);
        double[] out = new double[b.remaining() / 8];
        b.asDoubleBuffer().get(out);
        return out;
    }

    // ------------------------------------------------------------------ Kafka

    /** Print every group on the topic from the beginning up to its end offsets when it starts (at most {@code max}). */
    static void readTopic(Options options, Decoder decoder, PrintStream out, int max) {
        Properties props = new Properties();
        if (options.consumerConfig != null) {
            try (Reader in = Files.newBufferedReader(options.consumerConfig, StandardCharsets.UTF_8)) {
                props.load(in);  // security.protocol, sasl.*, ssl.*: Java client property names
            } catch (IOException e) {
                throw new ReaderException(1, "cannot read --consumer-config " + options.consumerConfig + ": " + e.getMessage());
            }
        }
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, options.bootstrapServers);
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");  // assigned, no group: commits nothing
        props.putIfAbsent(ConsumerConfig.CLIENT_ID_CONFIG, "rollstream-java-reader");
        long deadline = System.nanoTime() + (long) (options.timeoutS * 1e9);
        try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(props)) {
            List<PartitionInfo> infos = consumer.partitionsFor(options.topic, left(deadline));
            if (infos == null || infos.isEmpty()) {
                throw new ReaderException(1, "topic " + options.topic + " does not exist on " + options.bootstrapServers);
            }
            List<TopicPartition> partitions = infos.stream().map(p -> new TopicPartition(p.topic(), p.partition())).toList();
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
            Map<TopicPartition, Long> ends = consumer.endOffsets(partitions, left(deadline));
            Set<TopicPartition> unread = new HashSet<>();
            for (TopicPartition tp : partitions) {
                if (consumer.position(tp, left(deadline)) < ends.get(tp)) {
                    unread.add(tp);
                }
            }
            int printed = 0;
            while (!unread.isEmpty() && printed < max) {
                if (System.nanoTime() > deadline) {
                    throw new ReaderException(1, "read " + printed + " groups of " + options.topic + " but not to its end in "
                            + options.timeoutS + " s (partitions left: " + unread + "); raise --timeout-s");
                }
                for (ConsumerRecord<byte[], byte[]> rec : consumer.poll(Duration.ofMillis(200))) {
                    TopicPartition tp = new TopicPartition(rec.topic(), rec.partition());
                    if (printed >= max || rec.offset() >= ends.get(tp)) {
                        continue;  // past what was there when we started
                    }
                    Map<String, Object> line = new LinkedHashMap<>();
                    line.put("partition", rec.partition());
                    line.put("offset", rec.offset());
                    line.put("key", rec.key() == null ? null : new String(rec.key(), StandardCharsets.UTF_8));
                    String where = rec.topic() + " partition " + rec.partition() + " offset " + rec.offset();
                    line.putAll(decoder.decodeAt(rec.value(), where).toMap(options.tokens));
                    out.println(Json.of(line));
                    printed++;
                }
                unread.removeIf(tp -> consumer.position(tp) >= ends.get(tp));
            }
        } catch (org.apache.kafka.common.KafkaException e) {
            throw new ReaderException(1, "Kafka at " + options.bootstrapServers + ": " + e);
        }
    }

    private static Duration left(long deadline) {
        return Duration.ofNanos(Math.max(1_000_000L, deadline - System.nanoTime()));
    }

    private static byte[] readFile(Path file) {
        try {
            return Files.readAllBytes(file);
        } catch (IOException e) {
            throw new ReaderException(1, "cannot read " + file + ": " + e.getMessage());
        }
    }

    // ------------------------------------------------------------------ CLI

    /** An error that ends the run: its message, and the exit status. */
    static final class ReaderException extends RuntimeException {
        private static final long serialVersionUID = 1L;
        final int status;

        ReaderException(int status, String message) {
            super(message);
            this.status = status;
        }
    }

    static final class Options {
        static final String USAGE = "usage: GroupReader [--schema-dir DIR] (--bootstrap-servers HOST:PORT --topic NS.rollouts"
                + " [--consumer-config FILE] | --file RECORD ...) [--max N] [--timeout-s S] [--tokens] | --fingerprints";
        Path schemaDir;
        String bootstrapServers;
        String topic;
        Path consumerConfig;
        final List<Path> files = new ArrayList<>();
        int max = Integer.MAX_VALUE;
        double timeoutS = 30.0;
        boolean tokens;
        boolean fingerprints;

        static Options parse(String[] args) {
            Options o = new Options();
            for (int i = 0; i < args.length; i++) {
                String flag = args[i];
                switch (flag) {
                    case "--tokens" -> o.tokens = true;
                    case "--fingerprints" -> o.fingerprints = true;
                    case "--help", "-h" -> throw new ReaderException(0, USAGE);
                    default -> {
                        if (i + 1 >= args.length) {
                            throw new ReaderException(1, flag + " needs a value (or is unknown); " + USAGE);
                        }
                        o.set(flag, args[++i]);
                    }
                }
            }
            boolean kafka = o.bootstrapServers != null || o.topic != null;
            if (!o.fingerprints && (kafka ? o.bootstrapServers == null || o.topic == null : o.files.isEmpty())) {
                throw new ReaderException(1, "give --bootstrap-servers and --topic, or --file; " + USAGE);
            }
            return o;
        }

        private void set(String flag, String value) {
            try {
                switch (flag) {
                    case "--schema-dir" -> schemaDir = Path.of(value);
                    case "--bootstrap-servers" -> bootstrapServers = value;
                    case "--topic" -> topic = value;
                    case "--consumer-config" -> consumerConfig = Path.of(value);
                    case "--file" -> files.add(Path.of(value));
                    case "--max" -> max = positive(flag, Integer.parseInt(value));
                    case "--timeout-s" -> timeoutS = positive(flag, Double.parseDouble(value));
                    default -> throw new ReaderException(1, "unknown option " + flag + "; " + USAGE);
                }
            } catch (NumberFormatException e) {
                throw new ReaderException(1, flag + " expects a number, got " + value);
            }
        }

        private static <N extends Number> N positive(String flag, N value) {
            if (value.doubleValue() <= 0) {
                throw new ReaderException(1, flag + " must be above 0, got " + value);
            }
            return value;
        }
    }

    /** Just enough JSON for the output: maps, lists, primitive arrays, strings, numbers, booleans, null. */
    static final class Json {
        static String of(Object value) {
            StringBuilder out = new StringBuilder();
            write(value, out);
            return out.toString();
        }

        private static void write(Object v, StringBuilder out) {
            if (v == null || v instanceof Boolean || v instanceof Integer || v instanceof Long) {
                out.append(v);
            } else if (v instanceof Double || v instanceof Float) {
                out.append(v);  // text that parses back to the same value; NaN and Infinity as Python's json writes them
            } else if (v instanceof CharSequence s) {
                string(s, out);
            } else if (v instanceof Map<?, ?> m) {
                out.append('{');
                String sep = "";
                for (Map.Entry<?, ?> e : m.entrySet()) {
                    out.append(sep);
                    string(e.getKey().toString(), out);
                    out.append(':');
                    write(e.getValue(), out);
                    sep = ",";
                }
                out.append('}');
            } else if (v instanceof List<?> l) {
                array(l, out);
            } else if (v instanceof int[] a) {
                array(Arrays.stream(a).boxed().toList(), out);
            } else if (v instanceof long[] a) {
                array(Arrays.stream(a).boxed().toList(), out);
            } else if (v instanceof float[] a) {
                List<Float> l = new ArrayList<>(a.length);
                for (float f : a) {
                    l.add(f);
                }
                array(l, out);
            } else if (v instanceof byte[] a) {
                List<Integer> l = new ArrayList<>(a.length);
                for (byte b : a) {
                    l.add(b & 0xFF);
                }
                array(l, out);
            } else if (v instanceof Object[] a) {
                array(Arrays.asList(a), out);
            } else {
                throw new IllegalArgumentException("no JSON for " + v.getClass());
            }
        }

        private static void array(List<?> values, StringBuilder out) {
            out.append('[');
            for (int i = 0; i < values.size(); i++) {
                out.append(i == 0 ? "" : ",");
                write(values.get(i), out);
            }
            out.append(']');
        }

        private static void string(CharSequence s, StringBuilder out) {
            out.append('"');
            for (int i = 0; i < s.length(); i++) {
                char c = s.charAt(i);
                switch (c) {
                    case '"' -> out.append("\\\"");
                    case '\\' -> out.append("\\\\");
                    case '\n' -> out.append("\\n");
                    case '\r' -> out.append("\\r");
                    case '\t' -> out.append("\\t");
                    default -> {
                        if (c < 0x20) {
                            out.append(String.format("\\u%04x", (int) c));
                        } else {
                            out.append(c);  // non-ASCII as is: the output is UTF-8
                        }
                    }
                }
            }
            out.append('"');
        }
    }
}
