package embedcar.client;

import embedcar.v1.Embedcar.DType;
import embedcar.v1.Embedcar.EmbedReply;
import embedcar.v1.Embedcar.EmbedRequest;
import embedcar.v1.Embedcar.Hit;
import embedcar.v1.Embedcar.HitList;
import embedcar.v1.Embedcar.SearchMode;
import embedcar.v1.Embedcar.SearchReply;
import embedcar.v1.Embedcar.SearchRequest;
import embedcar.v1.EmbedderGrpc;
import io.grpc.ClientInterceptor;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.stub.MetadataUtils;
import java.nio.ByteOrder;
import java.nio.FloatBuffer;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * The embedcar sidecar's gRPC API for a JVM caller: a search node's plugin, a Vespa searcher or
 * embedder component. One instance per process; it holds one HTTP/2 connection and is thread-safe.
 *
 * <p>Every call carries a deadline: the sidecar refuses at once (RESOURCE_EXHAUSTED) what it could
 * not answer within it, so the caller can fall back to lexical search instead of waiting. Errors
 * surface as {@link io.grpc.StatusRuntimeException} with the sidecar's status code and message.
 */
public final class EmbedcarClient implements AutoCloseable {

    private static final Metadata.Key<String> API_KEY =
            Metadata.Key.of("x-api-key", Metadata.ASCII_STRING_MARSHALLER);

    private final ManagedChannel channel;
    private final EmbedderGrpc.EmbedderBlockingStub stub;

    /**
     * @param target "127.0.0.1:50051" (plaintext: the sidecar listens on loopback)
     * @param apiKey the tenant's key, or null where the sidecar runs without keys
     */
    public EmbedcarClient(String target, String apiKey) {
        this.channel = ManagedChannelBuilder.forTarget(target).usePlaintext().build();
        EmbedderGrpc.EmbedderBlockingStub s = EmbedderGrpc.newBlockingStub(channel);
        if (apiKey != null && !apiKey.isEmpty()) {
            Metadata headers = new Metadata();
            headers.put(API_KEY, apiKey);
            ClientInterceptor withKey = MetadataUtils.newAttachHeadersInterceptor(headers);
            s = s.withInterceptors(withKey);
        }
        this.stub = s;
    }

    /** One L2-normalised vector per text, in input order (float32 in the reply, copied out). */
    public Embeddings embed(List<String> texts, Duration deadline) {
        EmbedReply reply = stub.withDeadlineAfter(deadline.toNanos(), TimeUnit.NANOSECONDS)
                .embed(EmbedRequest.newBuilder().addAllTexts(texts).build());
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
        channel.shutdown();
        if (!channel.awaitTermination(5, TimeUnit.SECONDS)) {
            channel.shutdownNow();
        }
    }

    /** The vectors, the model version that computed them, and which came from the sidecar's cache. */
    public record Embeddings(float[][] vectors, String model, List<Boolean> cacheHits) {}
}
