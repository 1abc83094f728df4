package embedcar.client;

import embedcar.v1.Embedcar.DType;
import embedcar.v1.Embedcar.EmbedReply;
import embedcar.v1.Embedcar.EmbedRequest;
import embedcar.v1.Embedcar.Hit;
import embedcar.v1.Embedcar.HitList;
import embedcar.v1.Embedcar.SearchMode;
import embedcar.v1.Embedcar.SearchReply;
import embedcar.v1.Embedcar.SearchRequest;
import embedcar.v1.Embedcar.StreamReply;
import embedcar.v1.Embedcar.StreamRequest;
import embedcar.v1.EmbedderGrpc;
import io.grpc.ClientInterceptor;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.MetadataUtils;
import io.grpc.stub.StreamObserver;
import java.nio.ByteOrder;
import java.nio.FloatBuffer;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.concurrent.atomic.AtomicLong;

/**
 * The embedcar sidecar's gRPC API for a JVM caller: a search node's plugin, a Vespa searcher or
 * embedder component. One instance per process; it holds one HTTP/2 connection and is thread-safe.
 *
 * <p>Every call carries a deadline: the sidecar refuses at once (RESOURCE_EXHAUSTED) what it could
 * not answer within it, so the caller can fall back to lexical search instead of waiting. Errors
 * surface as {@link io.grpc.StatusRuntimeException} with the sidecar's status code and message.
 *
 * <p>{@link #embedOnStream} sends the same request as a message on one long-lived {@code Stream}
 * call instead of a unary call of its own: no call to set up per query, which costs the sidecar
 * (on the search node's own cores) ~0.1-0.6 ms less CPU and answers ~0.2-0.6 ms sooner (the
 * project's docs/benchmarks.md). The stream opens on first use and again after it ends.
 */
public final class EmbedcarClient implements AutoCloseable {

    private static final Metadata.Key<String> API_KEY =
            Metadata.Key.of("x-api-key", Metadata.ASCII_STRING_MARSHALLER);

    private final ManagedChannel channel;
    private final EmbedderGrpc.EmbedderBlockingStub stub;
    private final EmbedderGrpc.EmbedderStub asyncStub;
    private final AtomicLong ids = new AtomicLong();
    private final Map<Long, CompletableFuture<StreamReply>> pending = new ConcurrentHashMap<>();
    private StreamObserver<StreamRequest> stream; // guarded by this; null until opened, and after it ends

    /**
     * @param target "127.0.0.1:50051" (plaintext: the sidecar listens on loopback)
     * @param apiKey the tenant's key, or null where the sidecar runs without keys
     */
    public EmbedcarClient(String target, String apiKey) {
        this.channel = ManagedChannelBuilder.forTarget(target).usePlaintext().build();
        EmbedderGrpc.EmbedderBlockingStub s = EmbedderGrpc.newBlockingStub(channel);
        EmbedderGrpc.EmbedderStub a = EmbedderGrpc.newStub(channel);
        if (apiKey != null && !apiKey.isEmpty()) {
            Metadata headers = new Metadata();
            headers.put(API_KEY, apiKey);
            ClientInterceptor withKey = MetadataUtils.newAttachHeadersInterceptor(headers);
            s = s.withInterceptors(withKey);
            a = a.withInterceptors(withKey);
        }
        this.stub = s;
        this.asyncStub = a;
    }

    /** One L2-normalised vector per text, in input order (float32 in the reply, copied out). */
    public Embeddings embed(List<String> texts, Duration deadline) {
        return embeddings(stub.withDeadlineAfter(deadline.toNanos(), TimeUnit.NANOSECONDS)
                .embed(EmbedRequest.newBuilder().addAllTexts(texts).build()));
    }

    /**
     * {@link #embed}, sent as a message on the client's open {@code Stream} call. The deadline goes
     * with the message (the sidecar refuses what it cannot answer within it) and bounds the wait here.
     * Errors are the same {@link StatusRuntimeException}s a unary call ends with.
     */
    public Embeddings embedOnStream(List<String> texts, Duration deadline) {
        long id = ids.incrementAndGet();
        CompletableFuture<StreamReply> reply = new CompletableFuture<>();
        pending.put(id, reply);
        long ms = Math.max(1, deadline.toMillis());
        StreamRequest request = StreamRequest.newBuilder().setId(id).setTimeoutMs((int) Math.min(ms, Integer.MAX_VALUE))
                .setEmbed(EmbedRequest.newBuilder().addAllTexts(texts)).build();
        try {
            synchronized (this) { // a StreamObserver is not thread-safe
                if (stream == null) {
                    stream = asyncStub.stream(new Replies());
                }
                stream.onNext(request);
            }
            StreamReply r = reply.get(deadline.toNanos(), TimeUnit.NANOSECONDS);
            if (r.hasError()) {
                throw Status.fromCodeValue(r.getError().getCode()).withDescription(r.getError().getMessage())
                        .asRuntimeException();
            }
            return embeddings(r.getEmbed());
        } catch (TimeoutException e) {
            throw Status.DEADLINE_EXCEEDED.withDescription("no reply on the stream within " + deadline)
                    .asRuntimeException();
        } catch (ExecutionException e) {
            throw e.getCause() instanceof StatusRuntimeException sre ? sre : Status.fromThrowable(e.getCause())
                    .asRuntimeException();
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw Status.CANCELLED.withDescription("interrupted").asRuntimeException();
        } finally {
            pending.remove(id);
        }
    }

    /** Replies matched to their requests by id; the stream ending fails what is still waiting on it. */
    private final class Replies implements StreamObserver<StreamReply> {
        @Override
        public void onNext(StreamReply reply) {
            CompletableFuture<StreamReply> waiting = pending.get(reply.getId());
            if (waiting != null) {
                waiting.complete(reply);
            }
        }

        @Override
        public void onError(Throwable t) {
            ended(Status.fromThrowable(t).asRuntimeException());
        }

        @Override
        public void onCompleted() {
            ended(Status.UNAVAILABLE.withDescription("the sidecar closed the stream").asRuntimeException());
        }

        private void ended(StatusRuntimeException why) {
            synchronized (EmbedcarClient.this) {
                stream = null; // the next call opens a new one
            }
            pending.values().forEach(f -> f.completeExceptionally(why));
        }
    }

    private static Embeddings embeddings(EmbedReply reply) {
        if (reply.getDtype() != DType.FLOAT32) {
            throw new IllegalStateException("asked for float32, got " + reply.getDtype());
        }
        int rows = reply.getRows();
        int dim = reply.getDim();
        // rows x dim little-endian float32, row-major: read straight from the reply's bytes.
        FloatBuffer values = reply.getEmbeddings().asReadOnlyByteBuffer()
                .order(ByteOrder.LITTLE_ENDIAN).asFloatBuffer();
        if (values.remaining() != rows * dim) {
            throw new IllegalStateException("reply holds " + values.remaining() + " floats, not " + rows + "x" + dim);
        }
        float[][] out = new float[rows][dim];
        for (float[] row : out) {
            values.get(row);
        }
        return new Embeddings(out, reply.getModel(), reply.getCacheHitsList());
    }

    /** Top-k products per text from the sidecar's catalog index, best first. */
    public List<List<Hit>> search(List<String> texts, int k, SearchMode mode, Duration deadline) {
        SearchReply reply = stub.withDeadlineAfter(deadline.toNanos(), TimeUnit.NANOSECONDS)
                .search(SearchRequest.newBuilder().addAllTexts(texts).setK(k).setMode(mode).build());
        List<List<Hit>> out = new ArrayList<>();
        for (HitList hits : reply.getResultsList()) {
            out.add(hits.getHitsList());
        }
        return out;
    }

    @Override
    public void close() throws InterruptedException {
        synchronized (this) {
            if (stream != null) {
                stream.onCompleted();
                stream = null;
            }
        }
        channel.shutdown();
        if (!channel.awaitTermination(5, TimeUnit.SECONDS)) {
            channel.shutdownNow();
        }
    }

    /** The vectors, the model version that computed them, and which came from the sidecar's cache. */
    public record Embeddings(float[][] vectors, String model, List<Boolean> cacheHits) {}
}
